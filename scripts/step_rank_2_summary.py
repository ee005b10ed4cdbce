"""Summary of a `scripts/device_plan.py run step-rank-2` call: per run the step, compute, comm estimate and the
profile's parts, then per model the reference -> fast deltas of the parts items 1-2 of issue 36 change.

    python3 scripts/step_rank_2_summary.py <perf dir>

A run is the reference ("before") when its JSON's ``step_env`` sets any of the step switches
(``cadence.bench.step_report.STEP_SWITCHES``), else "after". The runs are separate processes: a bound, not
interleaved rounds; the profile's parts (kernel time per part) are what attributes each change.
"""

from __future__ import annotations

import json
import pathlib
import sys

#: parts each change should move (docs/perf/step/NOTES.md, issue 36 part 2)
WATCH = (
    "timestep",
    "linear",
    "qk_norm",
    "cache",
    "audio_embed",
    "norm_mod",
    "res_norm",
    "residual",
    "rope",
    "gaps",
)


def load(perf: pathlib.Path) -> list[tuple[str, dict, dict | None]]:
    runs = []
    for f in sorted(perf.glob("**/step/*.json")):
        if f.name.endswith("-profile.json"):
            continue
        d = json.loads(f.read_text())
        r = d["results"]
        pf = f.with_name(f.stem + "-profile.json")
        prof = json.loads(pf.read_text())["results"] if pf.exists() else None
        env = {k: v for k, v in (r.get("step_env") or {}).items() if v is not None}
        tag = "before" if env else "after"
        if "-attn" in f.stem:  # a run with another ring backend (--attention): its own row, no reference pair
            tag += " " + f.stem[f.stem.index("-attn") + 1 :]
        model = "flashtalk" if "flashtalk" in f.name else d["preset"]
        runs.append((f"{model} tp{d['tp']} {tag}", r, prof))
    return runs


def show(name: str, r: dict, prof: dict | None) -> None:
    print(
        f"\n## {name}: step {r['step_ms']:.1f} ms ({r.get('step_mode')}); compute {r.get('compute_ms') or 0:.1f}; "
        f"comm estimate {r.get('comm_estimate_ms') or 0:.1f}; switches {r.get('step_env')}"
    )
    if prof is None:
        return
    print(
        f"   profile ({prof['mode']}): parts add to {prof['step_ms']:.1f} ms; unnamed {prof['unnamed_share']:.1%}"
    )
    for p, v in sorted(prof["parts"].items(), key=lambda kv: -kv[1]["ms"]):
        if v["ms"] >= 0.05:
            fl = "-" if v["floor_ms"] is None else f"{v['floor_ms']:.2f}"
            print(f"   {p:>16} {v['ms']:8.2f} ms {v['count']:7.0f} k  floor {fl:>7}")


def main(perf: str) -> None:
    runs = load(pathlib.Path(perf))
    for run in runs:
        show(*run)
    by = {n: (r, p) for n, r, p in runs}
    for model in sorted({n.rsplit(" ", 1)[0] for n in by}):
        a, b = by.get(f"{model} after"), by.get(f"{model} before")
        if not (a and b):
            continue
        print(f"\n## {model}: reference -> fast (separate processes)")
        print(f"   step {b[0]['step_ms']:.1f} -> {a[0]['step_ms']:.1f}; compute {b[0].get('compute_ms') or 0:.1f} -> "
              f"{a[0].get('compute_ms') or 0:.1f}; comm estimate {b[0].get('comm_estimate_ms') or 0:.1f} -> "
              f"{a[0].get('comm_estimate_ms') or 0:.1f}")  # fmt: skip
        if a[1] and b[1]:
            for p in WATCH:
                x, y = b[1]["parts"].get(p, {}), a[1]["parts"].get(p, {})
                xm, ym = x.get("ms", 0.0), y.get("ms", 0.0)
                print(f"   {p:>16} {xm:8.2f} -> {ym:8.2f} ms ({ym - xm:+.2f}); kernels {x.get('count', 0):.0f} -> "
                      f"{y.get('count', 0):.0f}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
