"""Summary of a `scripts/device_plan.py run step-rank` call: per run the step, compute, comm estimate and the profile's parts
(ms per chunk or clip, scaled to all layers), and the W57 TP=4 before -> after deltas. Usage: python3
scripts/step_rank_summary.py <perf dir>."""

import json
import pathlib
import sys

runs = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("step/*.json")):
    if f.name.endswith("-profile.json"):
        continue
    d = json.loads(f.read_text())
    r = d["results"]
    pf = f.with_name(f.stem + "-profile.json")
    prof = json.loads(pf.read_text())["results"] if pf.exists() else None
    env = r.get("tp_env") or {}
    tag = "before" if env.get("CADENCE_TP_BIAS") == "after" else "after"
    runs.append((f"{d['preset']} tp{d['tp']}{' emu' if r.get('emulated') else ''} {tag}", r, prof))
for name, r, prof in runs:
    est = r.get("step_estimate_ms")
    print(
        f"\n## {name}: step {r['step_ms']:.1f} ms ({r['step_mode']}, p99 {r['step_p99_ms']:.1f}); compute "
        f"{r['compute_ms']:.1f}; comm estimate {r.get('comm_estimate_ms') or 0:.1f}; step estimate "
        f"{'-' if est is None else round(est, 1)}; graph x{r.get('graph_speedup') or 0:.2f}"
    )
    ce = r.get("comm_estimate") or {}
    if ce:
        print(
            f"   comm alternatives: cheapest {ce.get('total_ms_cheapest', 0):.1f}, symm halves "
            f"{ce.get('total_ms_symm_halves', 0):.1f}, fp8 gather (model) {ce.get('total_ms_fp8_gather', 0):.1f}"
        )
    if prof is None:
        continue
    print(
        f"   profile ({prof['mode']}): parts add to {prof['step_ms']:.1f} ms (step as scaled "
        f"{prof['step_as_scaled_ms']:.1f}); unnamed {prof['unnamed_share']:.1%}; "
        f"{prof.get('attribution', '')} {prof.get('graph_unavailable', '')}"
    )
    for p, v in sorted(prof["parts"].items(), key=lambda kv: -kv[1]["ms"]):
        if v["ms"] < 0.05:
            continue
        fl = "-" if v["floor_ms"] is None else f"{v['floor_ms']:.2f}"
        top = v["top"][0]["name"][:70] if v["top"] else ""
        print(f"   {p:>16} {v['ms']:8.2f} ms {v['count']:7.0f} k  floor {fl:>7}  {top}")
by = {n: (r, p) for n, r, p in runs}
a, b = by.get("w57 tp4 emu after"), by.get("w57 tp4 emu before")
if a and b:
    print("\n## W57 TP=4 before -> after (separate processes: a bound, not interleaved rounds)")
    print(
        f"   step {b[0]['step_ms']:.1f} -> {a[0]['step_ms']:.1f}; compute {b[0]['compute_ms']:.1f} -> "
        f"{a[0]['compute_ms']:.1f}; comm estimate {b[0]['comm_estimate_ms']:.1f} -> {a[0]['comm_estimate_ms']:.1f}"
    )
    if a[1] and b[1]:
        for p in a[1]["parts"]:
            x, y = b[1]["parts"][p]["ms"], a[1]["parts"][p]["ms"]
            if abs(x - y) >= 0.3:
                print(f"   {p:>16} {x:8.2f} -> {y:8.2f} ms ({y - x:+.2f})")
