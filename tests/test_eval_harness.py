"""The quality harness (cadence.eval.harness, `cadence eval`; issues 7 and 37): aggregation, verdicts, the
per-head attention judgement, skipped configurations, and one small end-to-end run on the CPU (tiny, random
weights) of the per-head command the lead runs on an H200, with --long and the PNG."""

import json
import math

import numpy as np
import pytest
from PIL import Image

from cadence.cli import main
from cadence.config import get_preset
from cadence.engine.recipe import EngineSpec, resolve
from cadence.eval import harness
from cadence.eval.harness import CONFIGS, aggregate, attention_verdict, compare, skip_reason

# ---- aggregation and verdicts with hand-made numbers ----------------------------------------------------


def test_aggregate_mean_and_rerun_spread():
    # 3 clips x 2 reruns: rerun clip-means are (1+3+5)/3 = 3 and (2+4+9)/3 = 5
    a = aggregate({"m": [[1.0, 2.0], [3.0, 4.0], [5.0, 9.0]]})["m"]
    assert a["per_rerun"] == pytest.approx([3.0, 5.0])
    assert a["mean"] == pytest.approx(4.0)
    assert a["rerun_spread"] == pytest.approx(2.0)  # max - min of the per-rerun clip-means
    # 3 reruns: the range, not a std (std of 0, 1, 4 would be ~1.7)
    b = aggregate({"m": [[0.0, 1.0, 4.0], [0.0, 1.0, 4.0]]})["m"]
    assert b["rerun_spread"] == pytest.approx(4.0) and b["mean"] == pytest.approx(5 / 3)
    with pytest.raises(ValueError):
        aggregate({"m": [1.0, 2.0]})


def _shifted(values, by):
    return [[x + by for x in row] for row in values]


def test_compare_flags_only_shifts_beyond_the_spread():
    vals = [[0.50, 0.60], [0.30, 0.40]]  # per-rerun means 0.40, 0.50: spread 0.10
    ref = aggregate({"lipsync_corr": vals, "identity_1s": vals})
    verdict, d = compare(ref, aggregate({"lipsync_corr": _shifted(vals, 0.05), "identity_1s": vals}))
    assert verdict == "within rerun spread"
    assert d["lipsync_corr"]["delta"] == pytest.approx(0.05) and d["lipsync_corr"][
        "threshold"
    ] == pytest.approx(0.1)
    assert not d["lipsync_corr"]["differs"] and not d["identity_1s"]["differs"]
    verdict, d = compare(ref, aggregate({"lipsync_corr": _shifted(vals, -0.15), "identity_1s": vals}))
    assert verdict.startswith("DIFFERS (lipsync_corr -0.15") and "identity_1s" not in verdict
    assert d["lipsync_corr"]["differs"] and not d["identity_1s"]["differs"]


def test_compare_uses_the_larger_of_the_two_spreads():
    steady = [[0.5, 0.5], [0.5, 0.5]]  # spread 0
    noisy = [[0.2, 1.2], [0.2, 1.2]]  # per-rerun means 0.2, 1.2: spread 1.0, mean 0.7
    ref = aggregate({"m": steady})
    assert compare(ref, aggregate({"m": noisy}))[0] == "within rerun spread"  # |0.2| < max(0, 1.0)
    assert compare(aggregate({"m": noisy}), ref)[0] == "within rerun spread"  # symmetric
    assert compare(ref, aggregate({"m": _shifted(steady, 0.2)}))[0].startswith("DIFFERS")  # 0.2 > max(0, 0)


# ---- configurations ------------------------------------------------------------------------------------


def test_tp_configs_are_skipped_without_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tiny = get_preset("tiny")
    for name, c in CONFIGS.items():
        why = skip_reason(c, tiny)
        assert (why is not None) == c.tp, name
        if c.tp:
            assert "torchrun" in why and "world size 1" in why
    # a world of 2 without an initialised process group is still not runnable, with its own reason
    assert "process group" in skip_reason(CONFIGS["fp8_ring_tp_fused"], tiny, world=2)


def test_aggregate_leaves_nan_out():
    # a clip without speech has no offset (NaN): the means are over the clips that have one
    a = aggregate({"m": [[1.0, 3.0], [math.nan, math.nan], [2.0, 5.0]]})["m"]
    assert a["per_rerun"] == pytest.approx([1.5, 4.0]) and a["mean"] == pytest.approx(2.75)
    assert a["rerun_spread"] == pytest.approx(2.5)
    empty = aggregate({"m": [[math.nan, math.nan]]})["m"]
    assert empty["mean"] is None and empty["rerun_spread"] is None
    ref = aggregate({"m": [[0.5, 0.5]], "n": [[1.0, 1.0]]})
    verdict, d = compare(ref, {"m": empty, "n": aggregate({"n": [[1.5, 1.5]]})["n"]})
    assert "m" not in d and verdict.startswith("DIFFERS (n +0.5")  # a metric without a value is not compared


def test_attention_verdict():
    ok = {"verdict": "within rerun spread"}
    assert attention_verdict([{"ring_fa3": ok, "ring_triton_head": ok}])["decision"] == "rank by speed"
    differs = {"verdict": "DIFFERS (sync_confidence -0.2 > spread 0.05)"}
    v = attention_verdict([{"ring_fa3": ok, "ring_triton_head": ok}, {"ring_fa3": differs}])  # the long pass
    assert v["decision"] == "keep opt-in" and "ring_fa3: DIFFERS" in v["why"]
    cpu = {"verdict": "not judged: fa3 did not run here (...)"}
    assert attention_verdict([{"ring_fa3": cpu, "ring_triton_head": ok}])["decision"] == "not judged"
    assert attention_verdict([{"reference": ok}])["decision"] == "not judged"


def test_attention_configs_resolve_to_the_asked_backend_on_cuda_and_say_why_not_on_the_cpu():
    spec = EngineSpec(model="tiny")
    for name, backend in (("ring_token", "triton"), ("ring_fa3", "fa3"), ("ring_triton_head", "triton_head")):
        c = CONFIGS[name]
        assert c.cache == "ring" and c.kv_fp8 and not c.fp8_linears and c.attention == backend
        cuda = resolve(harness.spec_for(c, spec, "cpu"), "cuda:0")  # what the same words build on a GPU
        assert cuda.config.stream.attention == backend and cuda.config.stream.kv_fp8
        cpu = resolve(harness.spec_for(c, spec, "cpu"), "cpu")
        assert cpu.config.stream.cache == "ring" and cpu.config.stream.kv_fp8  # FP8 numerics on the CPU too
        assert any(f"attention: {backend} needs a CUDA worker" in n for n in cpu.notes)
    assert list(harness.ATTENTION_CONFIGS) == ["reference", "ring_token", "ring_fa3", "ring_triton_head"]


# ---- end to end: the per-head command on the CPU ----------------------------------------------------------

E2E = "--model tiny --clips 1 --reruns 2 --seconds 1.5 --long 2 --device cpu".split()
E2E_CONFIGS = ["attention", "fp8_ring_graphs", "fp8_ring_tp_fused"]


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    import torch

    out = tmp_path_factory.mktemp("perf")
    mp = pytest.MonkeyPatch()
    mp.delenv("WORLD_SIZE", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engines' CPU threads (spec_for): steady on a shared 2-core machine
    try:
        rc = main(["eval", *E2E, "--configs", ",".join(E2E_CONFIGS), "--out-dir", str(out)])
    finally:
        torch.set_num_threads(threads)
        mp.undo()
    assert rc == 0
    files = list((out / "eval").glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text()), files[0], out


@pytest.mark.slow  # 20 streams of the tiny model + the landmark tracker
def test_e2e_json_schema_and_png(e2e):
    doc, path, out = e2e
    for key in ("bench", "preset", "tp", "device", "torch", "git", "command", "shape", "results", "recipe"):
        assert key in doc, key
    assert (
        doc["bench"] == "eval"
        and doc["preset"] == "tiny"
        and doc["command"].startswith("cadence eval --model tiny")
    )
    r = doc["results"]
    assert r["clips"] == 1 and r["reruns"] == 2 and r["metrics"] == list(harness.metric_names())
    names = [
        "ground_truth",
        "reference",
        "ring_token",
        "ring_fa3",
        "ring_triton_head",
        "fp8_ring_graphs",
        "fp8_ring_tp_fused",
    ]
    assert list(r["configs"]) == names
    assert list(r["long"]["configs"]) == names[1:]  # no ground truth for the long streams
    assert r["long"]["seconds"] == 2 and r["long"]["frames_per_clip"] == 48
    for name in ("reference", "ring_token", "fp8_ring_graphs"):
        c = r["configs"][name]
        for m in ("sync_confidence", "drift_identity_embedding", "drift_sharpness"):
            v = c[m]
            assert len(v["per_rerun"]) == 2 and v["mean"] == pytest.approx(np.mean(v["per_rerun"]))
            assert v["rerun_spread"] == pytest.approx(max(v["per_rerun"]) - min(v["per_rerun"]))
        assert set(c["curves"]) == {"identity_geometry", "identity_embedding", "colour_shift", "sharpness"}
        assert len(r["long"]["configs"][name]["curves"]["sharpness"]) == 2
        assert len(c["track"]["mouth"]) == 36 and len(c["track"]["energy"]) == 36
    m = r["measure"]
    assert m["max_offset_frames"] == 6 and "audio is late" in m["offset_sign"]
    png = path.with_suffix(".png")
    with Image.open(png) as im:
        assert im.size[0] >= 1000 and im.size[1] >= 600
    assert "tiny" in (out / "README.md").read_text()


@pytest.mark.slow  # 20 streams of the tiny model + the landmark tracker
def test_e2e_ground_truth_is_the_ceiling(e2e):
    r = e2e[0]["results"]
    gt = r["configs"]["ground_truth"]
    assert gt["sync_offset_frames"]["mean"] == 0 and gt["sync_confidence"]["mean"] > 0.5
    assert gt["drift_identity_embedding"]["mean"] < 0.2 and abs(gt["drift_sharpness"]["mean"] - 1) < 0.2
    # random weights draw no face: no landmarks, no sync
    ref = r["configs"]["reference"]
    assert ref["sync_confidence"]["mean"] < gt["sync_confidence"]["mean"] - 0.3


@pytest.mark.slow  # 20 streams of the tiny model + the landmark tracker
def test_e2e_verdicts_follow_the_rule_and_per_head_is_not_judged_on_the_cpu(e2e):
    r = e2e[0]["results"]
    for p in (r, r["long"]):
        ref, c = p["configs"]["reference"], p["configs"]["ring_token"]
        assert ref["verdict"] == "reference"
        flagged = []
        for m in p["metrics"]:
            if ref[m]["mean"] is None or c[m]["mean"] is None:
                assert "differs" not in c[m]
                continue
            delta = c[m]["mean"] - ref[m]["mean"]
            thr = max(c[m]["rerun_spread"], ref[m]["rerun_spread"])
            assert c[m]["differs"] == (abs(delta) > thr)
            flagged += [m] if abs(delta) > thr else []
        assert (c["verdict"] == "within rerun spread") == (not flagged)
        for name in ("ring_fa3", "ring_triton_head"):
            h = p["configs"][name]
            assert h["attention_effective"]["scales"] == "token"  # the CPU ran the per-token reference
            assert h["verdict"].startswith("not judged") and "CUDA" in h["verdict"]
        assert p["configs"]["reference"]["attention_effective"]["backend"].startswith("naive")
        assert p["configs"]["ring_token"]["attention_effective"]["backend"] == "reference"
    assert r["per_head_attention"]["decision"] == "not judged"
    cs = r["configs"]
    assert (
        cs["fp8_ring_graphs"]["effective"] == "eager (no CUDA)"
        and cs["fp8_ring_graphs"]["build"]["fp8_layers"] > 0
    )
    assert "torchrun" in cs["fp8_ring_tp_fused"]["skipped"]


# ---- command line ------------------------------------------------------------------------------------


def test_cli_eval_help_and_one_line_errors(capsys):
    assert main(["eval", "--help"]) == 0
    assert "--long" in capsys.readouterr().out
    assert main(["bench", "eval", "--help"]) == 0
    assert "--measure-check" in capsys.readouterr().out
    for bad, words in (
        (["--configs", "reference,nope"], "unknown configuration"),
        (["--reruns", "1"], "--reruns must be >= 2"),
        (["--clips", "0"], "--clips must be >= 1"),
        (["--seconds", "-1"], "seconds >= 0"),
        (["--model", "nope"], "unknown preset or model family"),
    ):
        assert main(["eval", *bad]) == 2, bad
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and words in err[0], err


def test_harness_lists_the_issue_configurations():
    c = CONFIGS
    assert (c["reference"].cache, c["reference"].fp8_linears, c["reference"].kv_fp8) == (
        "naive",
        False,
        False,
    )
    assert all(
        c[n].cache == "ring" and c[n].kv_fp8 and c[n].fp8_linears
        for n in ("fp8_ring", "fp8_ring_graphs", "fp8_ring_tp_fused")
    )
    assert c["fp8_ring_graphs"].graphs and not c["fp8_ring"].graphs and c["fp8_ring_tp_fused"].tp
    assert harness.PER_HEAD == ("fa3", "triton_head")


def test_compare_does_not_flag_a_delta_equal_to_the_spread_up_to_rounding():
    # -1 + 1/12 is 1/12 above -1 and the spread is 1/12, but the float difference is 4e-17 larger
    ref = {"m": {"mean": -1.0, "rerun_spread": 1 / 12}}
    other = {"m": {"mean": -11 / 12, "rerun_spread": 0.0}}
    assert abs(other["m"]["mean"] - ref["m"]["mean"]) > 1 / 12  # the rounding the rule must not count
    assert compare(ref, other)[0] == "within rerun spread"
    assert compare(ref, {"m": {"mean": -0.9, "rerun_spread": 0.0}})[0].startswith("DIFFERS")


def test_evaluate_runs_a_model_family():
    """Any family through the public spec: Self-Forcing (text-to-video, 16 fps, no image sink) at the tiny
    geometry of its parity fixture, with the fixture's weights file: the clips follow its size and fps."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from test_families_self_forcing import CKPT, HW, TINY_MODEL

    from cadence.eval.clips import prepare_clips

    spec = EngineSpec(
        model="self-forcing", overrides={"model": dict(TINY_MODEL, weights=str(CKPT)), "stream": dict(HW)}
    )
    cfg = spec.config()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        clips = prepare_clips(cfg, 1, 2.5)
        r = harness.evaluate(spec, ["reference", "ring_token"], clips, 2, "cpu")
    finally:
        torch.set_num_threads(threads)
    assert (
        clips[0].reference.shape == (HW["height"], HW["width"], 3)
        and r["fps"] == 16
        and r["frames_per_clip"] == 40
    )
    ref = r["configs"]["reference"]
    assert ref["recipe"]["family"] == "self-forcing" and ref["recipe"]["weights"] == str(CKPT)
    assert r["configs"]["ring_token"]["recipe"]["cache"] == "ring"
    assert (
        r["configs"]["ground_truth"]["sync_offset_frames"]["mean"] == 0
    )  # the clip's own animation, at 32x48
    for c in ("reference", "ring_token"):
        assert (
            len(r["configs"][c]["curves"]["sharpness"]) == 3 and r["configs"][c]["verdict"]
        )  # 2.5 s: 3 seconds


def test_cli_old_drift_seconds_flag_is_accepted_with_a_note():
    a = __import__("cadence.bench.eval", fromlist=["parse"]).parse(
        ["--seconds", "8", "--drift-seconds", "1,8"]
    )
    assert a.drift_seconds == "1,8" and a.seconds == 8.0 and a.clips == 50
