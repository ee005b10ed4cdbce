"""The side-by-side table of one device call (not part of Cadence; run by hand on the
merged perf/ folders of the plans families-ref and families-cadence, scripts/device_plans.toml).

    python scripts/reference_table.py PERF_DIR [--git SHA] [--command "..."]

Reads the references' JSON (``PERF_DIR/reference/<name>.json``, scripts/reference_*_bench.py) and Cadence's
(``PERF_DIR/cadence/<name>/**.json``, ``bench pipeline`` through scripts/reference_cadence_run.py), pairs them
by ``<name>`` (self-forcing-wan, self-forcing-taehv, causvid, longlive, krea-14b, flashtalk), prints one table
(fps over the run and steady, time to first frames, per-block / per-chunk time, peak GPU memory, the ratio
Cadence / reference of steady fps and of time to first frames) and writes it as one JSON in the bench schema
of docs/benchmarks.md (``bench`` "reference", ``command``, ``device``, ``git``, ``shape``, ``results.rows``) to
``PERF_DIR/families/side-by-side.json``. A side that is missing (not run, crashed, skipped for time) is a row
with that side empty, never a number."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def ref_row(r: dict) -> dict:
    return dict(
        fps_video=r.get("fps_video"),
        fps_steady=r.get("fps_steady"),
        ttff_ms=r.get("ttff_ms"),
        block_ms=r.get("block_ms_median_steady"),
        peak_mem_gib=r.get("peak_mem_gib"),
        compile=r.get("compile"),
        dtype=r.get("dtype"),
        attention=r.get("attention"),
        first_run_s=r.get("first_run_s"),
        commit=r.get("reference_commit"),
        finite=r.get("finite"),
    )


def cadence_row(d: dict) -> dict:
    r = d.get("results", {})
    return dict(
        fps=r.get("fps"),
        ttff_ms=r.get("ttff_ms"),
        latency_p50_ms=r.get("latency_p50_ms"),
        diffusion_ms=r.get("diffusion_ms"),
        decode_ms=r.get("decode_ms"),
        peak_mem_gib=r.get("peak_mem_gib"),
        misses=r.get("deadline_misses"),
        chunks=r.get("chunks"),
        shape_changes=r.get("shape_changes"),
        command=d.get("command"),
    )


def ratio(a, b):
    return a / b if a and b else None


def fmt(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("perf", type=Path)
    ap.add_argument("--git", default="")
    ap.add_argument("--command", default="python3 scripts/device_plan.py run families-ref / families-cadence")
    a = ap.parse_args()
    refs = {f.stem: json.loads(f.read_text()) for f in sorted((a.perf / "reference").glob("*.json"))}
    cads = {}
    for d in sorted((a.perf / "cadence").glob("*")) if (a.perf / "cadence").is_dir() else []:
        files = sorted(d.rglob("*.json"))
        if files:
            cads[d.name] = json.loads(files[-1].read_text())
    rows, device = [], None
    # a Cadence row is paired with the reference of its name, else with that reference's eager run
    pair = {n: n if n in refs else (f"{n}-eager" if f"{n}-eager" in refs else None) for n in cads}
    names = sorted(set(cads) | (set(refs) - set(pair.values())))
    for name in names:
        rn = pair.get(name, name if name in refs else None)
        r = ref_row(refs[rn]) if rn else None
        c = cadence_row(cads[name]) if name in cads else None
        device = device or (refs.get(rn) or {}).get("device") or (cads.get(name) or {}).get("device")
        rows.append(
            dict(
                name=name,
                reference_record=rn,
                reference=r,
                cadence=c,
                fps_ratio_vs_steady=ratio(c and c["fps"], r and r["fps_steady"]),
                fps_ratio_vs_video=ratio(c and c["fps"], r and r["fps_video"]),
                ttff_ratio=ratio(r and r["ttff_ms"], c and c["ttff_ms"]),
            )
        )
    head = (
        "| family | reference fps (run / steady) | ref ttff ms | ref block ms | ref peak GiB | Cadence fps | "
    )
    head += (
        "Cadence ttff ms | Cadence latency p50 ms | Cadence peak GiB | fps ratio (vs steady) | ttff ratio |"
    )
    print(head)
    print("|" + " --- |" * 11)
    for x in rows:
        r, c = x["reference"] or {}, x["cadence"] or {}
        label = x["name"] + (
            f" (ref: {x['reference_record']})" if x["reference_record"] not in (None, x["name"]) else ""
        )
        print(
            f"| {label} | {fmt(r.get('fps_video'))} / {fmt(r.get('fps_steady'))} | {fmt(r.get('ttff_ms'), '.0f')} "
            f"| {fmt(r.get('block_ms'), '.0f')} | {fmt(r.get('peak_mem_gib'))} | {fmt(c.get('fps'))} | "
            f"{fmt(c.get('ttff_ms'), '.0f')} | {fmt(c.get('latency_p50_ms'), '.0f')} | {fmt(c.get('peak_mem_gib'))} "
            f"| {fmt(x['fps_ratio_vs_steady'], '.2f')}{'x' if x['fps_ratio_vs_steady'] else ''} | "
            f"{fmt(x['ttff_ratio'], '.2f')}{'x' if x['ttff_ratio'] else ''} |"
        )
    out = a.perf / "families" / "side-by-side.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(
        bench="reference",
        preset="families",
        tp=1,
        device=device,
        git=a.git,
        command=a.command,
        shape=dict(families=[x["name"] for x in rows]),
        results=dict(rows=rows),
    )
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
