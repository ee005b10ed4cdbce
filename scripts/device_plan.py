"""Run one device plan of scripts/device_plans.toml: named lists of commands with their time limits.

    python3 scripts/device_plan.py list                       # the plans, their machine and budget
    python3 scripts/device_plan.py show NAME [--smoke]        # the commands a plan runs, expanded
    python3 scripts/device_plan.py run NAME [--smoke] [--only STEP,...] [--budget-s S] [--out DIR]
                                            [--pythonpath DIR] [--no-tar] [--dry-run]

On the GPU machine a plan is one call, from the repository root, carrying what the plan's ``carry`` names, e.g.
``CADENCE_GIT=<sha> python3 scripts/device_plan.py run attention`` (the device copy has no usable .git:
CADENCE_GIT is the commit the records name). ``--smoke`` runs the same plan on a CPU: each step's CPU form
(the ``smoke_vars`` / ``smoke_run`` of the table, the tiny preset), steps marked ``smoke = false`` skipped.

Each step runs under its limit, capped by what is left of the plan's budget (a step with under 20 s left is
skipped, and says so); a ``required`` step that fails stops the plan. Per step: one ``===`` line with the
command, the last 80 lines of its output (progress lines dropped; the whole log in ``OUT/logs/<step>.log``),
and its exit status (124: killed at its limit). At the end a table, ``OUT/plan-<name>.json`` (every command
with its limit, status and seconds) and, unless ``--no-tar``, ``OUT/<name>.tgz`` of ``OUT/perf`` (the device
returns a few files only). The benchmarks write their JSON records under ``OUT/perf``; copy what a run
recorded into docs/perf/ (the table's ``records``) and read it in the NOTES.md there.

The table's format is described at its top. How the project measures (interleaved variants, at least five
rounds for a ratio): docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = Path(__file__).with_name("device_plans.toml")
MACHINES = ("nvidia-h200", "nvidia-h200-x2", "nvidia-h200-x4", "nvidia-h200-x8")
MIN_LEFT_S = 20
TAIL_LINES = 80
NOISE = re.compile(r"^steps:|chunks:|OMP_NUM_THREADS|^\*{4}")
#: Every step's environment: the checkout importable, unbuffered output, NVLink multicast off.
BASE_ENV = {
    "PYTHONUNBUFFERED": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


class PlanError(ValueError):
    """A plan that does not exist or does not expand (an unknown placeholder, a bad field)."""


@dataclass
class Step:
    name: str
    limit_s: int
    command: str
    env: dict[str, str] = field(default_factory=dict)
    required: bool = False


@dataclass
class Plan:
    name: str
    about: str
    machine: str
    budget_s: int
    carry: list[str]
    wheels: list[str]
    records: str
    env: dict[str, str]
    steps: list[Step]


def load_table(path: Path = TABLE) -> dict[str, dict]:
    """The raw plans of the TOML table, by name."""
    with open(path, "rb") as fh:
        return tomllib.load(fh)["plans"]


def expand(template: str, values: dict[str, str]) -> str:
    """``{NAME}`` replaced by its value (values may hold placeholders too); ``{{`` / ``}}`` are braces."""

    def sub(m: re.Match) -> str:
        if m.group(0) in ("{{", "}}"):
            return m.group(0)
        if m.group(1) not in values:
            raise PlanError(f"unknown placeholder {{{m.group(1)}}} in {template!r}")
        return values[m.group(1)]

    text = template
    for _ in range(5):  # a value may name another: STEP holds {PERF}
        new = _PLACEHOLDER.sub(sub, text)
        if new == text:
            break
        text = new
    return text.replace("{{", "{").replace("}}", "}")


def _steps(raw_steps: list[dict], values: dict[str, str], smoke: bool) -> list[Step]:
    """The table's steps as run: smoke forms, variants interleaved over rounds (A B A B ...), expanded."""
    out = []
    for raw in raw_steps:
        if smoke and raw.get("smoke", True) is False:
            continue
        template = raw.get("smoke_run", raw["run"]) if smoke else raw["run"]
        limit = int(raw["limit_s"])
        if not 0 < limit <= 600:
            raise PlanError(f"step {raw['name']}: limit_s {limit} is not in 1..600")
        variants = raw.get("variants")
        runs = [(raw["name"], {})]
        if variants:
            rounds = int(raw.get("rounds", 1))
            runs = [
                (
                    f"{raw['name']}-{label}" + (f"-r{k}" if rounds > 1 else ""),
                    {"variant": w, "label": label, "round": str(k)},
                )
                for k in range(1, rounds + 1)
                for label, w in variants.items()
            ]
        for name, extra in runs:
            cmd = " ".join(expand(template, values | extra).split())
            env = {k: str(v) for k, v in raw.get("env", {}).items()}
            out.append(Step(name, limit, cmd, env, bool(raw.get("required", False))))
    return out


def plan(name: str, smoke: bool = False, out: str | Path = "/tmp/out", table: dict | None = None) -> Plan:
    """The named plan, expanded for the GPU (or, with ``smoke``, for a CPU), its results under ``out``."""
    table = load_table() if table is None else table
    if name not in table:
        raise PlanError(f"no plan {name!r}; the plans: {', '.join(table)}")
    raw = table[name]
    machine = raw.get("machine", "nvidia-h200")
    if machine not in MACHINES:
        raise PlanError(f"plan {name}: machine {machine!r} is not one of {', '.join(MACHINES)}")
    values = {"OUT": str(out), "PERF": str(Path(out) / "perf")}
    values |= {k: str(v) for k, v in raw.get("vars", {}).items()}
    if smoke:
        values |= {k: str(v) for k, v in raw.get("smoke_vars", {}).items()}
    env = {k: str(v) for k, v in raw.get("env", {}).items()}
    if smoke:
        env |= {k: str(v) for k, v in raw.get("smoke_env", {}).items()}
    return Plan(
        name=name,
        about=raw.get("about", ""),
        machine=machine,
        budget_s=int(raw.get("budget_s", 540)),
        carry=list(raw.get("carry", [])),
        wheels=[] if smoke else list(raw.get("wheels", [])),
        records=raw.get("records", ""),
        env=env,
        steps=_steps(raw["steps"], values, smoke),
    )


def _install_wheels(globs: list[str], site: Path) -> str | None:
    """Install the plan's wheels (no index, no dependencies) into ``site``; None when no wheel is there."""
    wheels = sorted({w for g in globs for w in glob.glob(str(ROOT / g))})
    if not wheels:
        print(f"=== wheels: none of {' '.join(globs)} here (not carried?)", flush=True)
        return None
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    subprocess.run([*cmd, "--target", str(site), *wheels], cwd=ROOT, check=False)
    print(f"=== wheels: {len(wheels)} installed into {site}", flush=True)
    return str(site)


def run_step(step: Step, env: dict[str, str], limit_s: float, log: Path) -> int:
    """Run one step's command under ``limit_s`` (its process group killed then: 124); its output to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            ["bash", "-c", step.command],
            cwd=ROOT,
            env=env | step.env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return 124


def _tail(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if not NOISE.search(ln)]
    return "\n".join(lines[-TAIL_LINES:])


def _environment(p: Plan, pythonpath: list[str]) -> dict[str, str]:
    """The steps' environment: the process's, the base, the plan's, PYTHONPATH = extra folders + the checkout."""
    env = dict(os.environ) | BASE_ENV | p.env
    env.setdefault("OMP_NUM_THREADS", "4")
    site = _install_wheels(p.wheels, Path("/tmp/cadence-plan-site") / p.name) if p.wheels else None
    paths = [*pythonpath, *([site] if site else []), str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def run_plan(
    p: Plan, out: Path, budget_s: float, pythonpath: list[str], only: list[str], dry_run: bool
) -> list[dict]:
    """Run the plan's steps (those ``only`` names, or all) in order; one row per step."""
    (out / "perf").mkdir(parents=True, exist_ok=True)
    env = _environment(p, pythonpath) if not dry_run else {}
    t0, rows = time.monotonic(), []
    stop = False
    for step in p.steps:
        if only and not any(step.name == o or step.name.startswith(o + "-") for o in only):
            continue
        left = budget_s - (time.monotonic() - t0)
        row = {
            "name": step.name,
            "command": step.command,
            "limit_s": step.limit_s,
            "rc": None,
            "seconds": 0.0,
        }
        if stop or left < MIN_LEFT_S or dry_run:
            row["skipped"] = (
                "dry run" if dry_run else ("a required step failed" if stop else f"budget: {left:.0f} s left")
            )
            print(f"=== SKIP {step.name} ({row['skipped']}): {step.command}", flush=True)
            rows.append(row)
            continue
        limit = min(step.limit_s, left)
        print(
            f"=== {step.name} (limit {limit:.0f} s, t={time.monotonic() - t0:.0f} s): {step.command}",
            flush=True,
        )
        s0 = time.monotonic()
        log = out / "logs" / f"{step.name}.log"
        row["rc"] = run_step(step, env, limit, log)
        row["seconds"] = round(time.monotonic() - s0, 1)
        print(_tail(log), flush=True)
        print(f"=== {step.name}: rc={row['rc']} in {row['seconds']:.0f} s", flush=True)
        stop = stop or (step.required and row["rc"] != 0)
        rows.append(row)
    return rows


def _git() -> str:
    if os.environ.get("CADENCE_GIT"):
        return os.environ["CADENCE_GIT"]
    try:
        r = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        return r.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _finish(p: Plan, rows: list[dict], out: Path, smoke: bool, tar: bool) -> None:
    """The summary table, OUT/plan-<name>.json and OUT/<name>.tgz of OUT/perf."""
    print(f"=== {p.name}: {'step':<36} {'rc':>4} {'s':>6}")
    for r in rows:
        print(f"    {r['name']:<42} {str(r['rc'] if r['rc'] is not None else '-'):>4} {r['seconds']:6.0f}")
    summary = {"plan": p.name, "machine": p.machine, "smoke": smoke, "git": _git(), "about": p.about}
    summary |= {"records": p.records, "steps": rows}
    (out / f"plan-{p.name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    if tar and any((out / "perf").iterdir()):
        with tarfile.open(out / f"{p.name}.tgz", "w:gz") as t:
            t.add(out / "perf", arcname="perf")


def _print_plan(p: Plan) -> None:
    print(f"{p.name}: {p.about}\n  machine {p.machine}, budget {p.budget_s} s", end="")
    print(f", carry {' '.join(p.carry)}" if p.carry else "", end="")
    print(f", wheels {' '.join(p.wheels)}" if p.wheels else "", end="")
    print(f"\n  records: {p.records or '-'}")
    for s in p.steps:
        extra = (" [required]" if s.required else "") + "".join(f" {k}={v}" for k, v in s.env.items())
        print(f"  {s.name} ({s.limit_s} s){extra}: {s.command}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="device_plan.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the plans")
    show = sub.add_parser("show", help="a plan's commands, expanded")
    run = sub.add_parser("run", help="run a plan")
    for p in (show, run):
        p.add_argument("name")
        p.add_argument("--smoke", action="store_true", help="the CPU form of the plan (tiny preset)")
        p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="results folder ($OUT)")
    run.add_argument("--only", default="", help="comma list of step names (a name selects its variants)")
    run.add_argument("--budget-s", type=float, default=None, help="the call's budget (default: the plan's)")
    run.add_argument("--pythonpath", action="append", default=[], help="a folder put first on PYTHONPATH")
    run.add_argument("--no-tar", action="store_true", help="no OUT/<name>.tgz of OUT/perf")
    run.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            for name, raw in load_table().items():
                print(
                    f"{name:<20} {raw.get('machine', 'nvidia-h200'):<16} {raw.get('budget_s', 540):>4} s  {raw.get('about', '')[:90]}"
                )
            return 0
        p = plan(args.name, smoke=args.smoke, out=args.out)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "show":
        _print_plan(p)
        return 0
    out = Path(args.out)
    only = [o for o in args.only.split(",") if o]
    rows = run_plan(p, out, args.budget_s or p.budget_s, args.pythonpath, only, args.dry_run)
    _finish(p, rows, out, args.smoke, tar=not args.no_tar and not args.dry_run)
    return 1 if any(r["rc"] not in (0, None) for r in rows) else 0


if __name__ == "__main__":
    if shutil.which("bash") is None:
        sys.exit("error: the plans need bash")
    sys.exit(main())
