"""The device plans (scripts/device_plans.toml) and their runner (scripts/device_plan.py).

What a plan measures needs a GPU; what is checked here is that every plan expands (for the GPU and for
``--smoke`` on a CPU) into commands the runner can start, that variants interleave round by round, that the
runner keeps its limits (a step past its limit is killed with 124 and the plan goes on; a failed ``required``
step stops it; a step the budget cannot hold is skipped and says so), and that one plan's smoke runs here.
That each benchmark command still parses with today's flags: tests/test_recipe.py.
"""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _runner():
    spec = importlib.util.spec_from_file_location("device_plan", ROOT / "scripts" / "device_plan.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def test_every_plan_expands_for_the_gpu_and_for_a_cpu():
    dp = _runner()
    table = dp.load_table()
    assert len(table) >= 10
    for name, raw in table.items():
        assert raw.get("about") and raw.get("machine") in dp.MACHINES, name
        for smoke in (False, True):
            p = dp.plan(name, smoke=smoke, out="/tmp/o")  # an unknown {placeholder}: PlanError
            assert 0 < p.budget_s <= 600, name  # one call on the device machine: 10 minutes at most
            names = [s.name for s in p.steps]
            assert len(names) == len(set(names)), (name, names)
            for s in p.steps:
                assert 0 < s.limit_s <= p.budget_s, (name, s.name)
                for path in re.findall(r"(?:^|\s)((?:scripts|tests)/[\w./-]+\.(?:py|sh))", s.command):
                    assert (ROOT / path).is_file(), (name, s.name, path)
        assert dp.plan(name).steps, name  # the GPU form runs something


def test_variants_interleave_round_by_round():
    dp = _runner()
    steps = [s.name for s in dp.plan("fused-quant").steps if s.name.startswith("w57")]
    assert steps[:4] == [
        "w57-tp4-emu-fused-r1",
        "w57-tp4-emu-separate-r1",
        "w57-tp4-emu-fused-r2",
        "w57-tp4-emu-separate-r2",
    ]
    assert len(steps) >= 10  # a ratio from at least five rounds (docs/benchmarks.md)
    cmds = [s.command for s in dp.plan("fused-quant").steps]
    assert "--fused-quant" in cmds[0] and "--no-fused-quant" in cmds[1] and "/fused-r1" in cmds[0]


def _table(*steps, budget_s=60):
    return {"t": {"about": "test", "machine": "nvidia-h200", "budget_s": budget_s, "steps": list(steps)}}


def test_the_runner_keeps_its_limits(tmp_path):
    dp = _runner()
    py = sys.executable
    table = _table(
        {"name": "slow", "limit_s": 1, "run": f"{py} -c 'import time; time.sleep(30)'"},
        {"name": "after", "limit_s": 10, "run": "echo ran-after"},
        {"name": "check", "limit_s": 10, "run": "exit 3", "required": True},
        {"name": "never", "limit_s": 10, "run": "echo never"},
    )
    rows = dp.run_plan(dp.plan("t", table=table, out=tmp_path), tmp_path, 60, [], [], dry_run=False)
    got = {r["name"]: r for r in rows}
    assert got["slow"]["rc"] == 124 and got["slow"]["seconds"] < 10
    assert got["after"]["rc"] == 0 and "ran-after" in (tmp_path / "logs" / "after.log").read_text()
    assert got["check"]["rc"] == 3
    assert got["never"]["rc"] is None and got["never"]["skipped"] == "a required step failed"
    # a budget with less than 20 s left for a step: skipped, with the reason
    table = _table({"name": "one", "limit_s": 5, "run": "true"}, budget_s=15)
    (row,) = dp.run_plan(dp.plan("t", table=table, out=tmp_path), tmp_path, 15, [], [], dry_run=False)
    assert row["rc"] is None and row["skipped"].startswith("budget")


def test_the_smoke_of_the_recipe_plan_runs_on_this_cpu(tmp_path):
    """`device_plan.py run recipe --smoke`: the commands a new user types, on this CPU (two of its steps: the
    whole smoke takes ~30 s here, its pipelines included)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "scripts/device_plan.py", "run", "recipe", "--smoke", "--out", str(out)]
    r = subprocess.run(
        [*cmd, "--only", "recipe-character,recipe-self-forcing"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "plan-recipe.json").read_text())
    assert summary["smoke"] and [s["name"] for s in summary["steps"]] == [
        "recipe-character",
        "recipe-self-forcing",
    ]
    assert all(s["rc"] == 0 for s in summary["steps"])
    log = (out / "logs" / "recipe-self-forcing.log").read_text()
    assert "self-forcing" in log and "cpu" in log
    assert "=== recipe-character: rc=0" in r.stdout
