"""The quality harness (cadence.eval.harness, `cadence eval`; issue 7 item 5): aggregation, verdicts,
streamed metrics, skipped configurations, and one small end-to-end run on the CPU (tiny, random weights)."""

import json

import numpy as np
import pytest

from cadence.cli import main
from cadence.config import get_preset
from cadence.eval import harness
from cadence.eval.harness import CONFIGS, StreamMetrics, aggregate, compare, skip_reason
from cadence.eval.metrics import identity_drift, lipsync
from cadence.train.data import held_out_split

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


# ---- streamed metrics equal the whole-stream metrics ----------------------------------------------------


@pytest.mark.parametrize("chunk", [4, 5])
def test_stream_metrics_equal_metrics_on_all_frames(chunk):
    clip = held_out_split(0, 1, seed=3)[1][0].make(1.5)
    acc = StreamMetrics(clip.reference, clip.face_box)
    for i in range(0, len(clip.frames), chunk):
        acc.add(clip.frames[i : i + chunk])
    got = acc.result(clip.audio, (0.5, 1.0, 2.0), fps=24)
    want = lipsync(clip.frames, clip.audio, face_box=clip.face_box)
    assert got["lipsync_corr"] == pytest.approx(want["corr"], abs=1e-9)
    assert got["lipsync_offset_frames"] == want["offset_frames"]
    drift = identity_drift(clip.frames, clip.reference, (0.5, 1.0, 2.0), face_box=clip.face_box)
    assert set(drift) == {0.5, 1.0} and "identity_2s" not in got  # 2 s is past the end of a 1.5 s clip
    assert got["identity_0.5s"] == pytest.approx(drift[0.5], abs=1e-7)
    assert got["identity_1s"] == pytest.approx(drift[1.0], abs=1e-7)


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


# ---- end to end: cadence eval on the CPU --------------------------------------------------------------

E2E_CONFIGS = ["reference", "fp8_ring_graphs", "fp8_ring_tp_fused"]


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    out = tmp_path_factory.mktemp("perf")
    mp = pytest.MonkeyPatch()
    mp.delenv("WORLD_SIZE", raising=False)
    try:
        rc = main(
            [
                "eval",
                "--preset",
                "tiny",
                "--clips",
                "2",
                "--reruns",
                "2",
                "--seconds",
                "1",
                "--drift-seconds",
                "0.5,1",
                "--configs",
                ",".join(E2E_CONFIGS),
                "--device",
                "cpu",
                "--out-dir",
                str(out),
            ]
        )
    finally:
        mp.undo()
    assert rc == 0
    files = list((out / "eval").glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text()), out


def test_e2e_json_schema(e2e):
    doc, out = e2e
    for key in ("bench", "preset", "tp", "device", "torch", "git", "command", "shape", "results"):
        assert key in doc, key
    assert doc["bench"] == "eval" and doc["preset"] == "tiny" and doc["tp"] == 1
    assert doc["command"].startswith("cadence eval --preset tiny")
    r = doc["results"]
    for key in ("configs", "lipsync_corr_reference", "clips", "reruns", "metrics"):
        assert key in r, key
    assert r["clips"] == 2 and r["reruns"] == 2 and len(r["clip_seeds"]) == 2
    assert r["metrics"] == ["lipsync_corr", "lipsync_offset_frames", "identity_0.5s", "identity_1s"]
    assert list(r["configs"]) == ["ground_truth", *E2E_CONFIGS]
    for name in ("reference", "fp8_ring_graphs"):
        c = r["configs"][name]
        assert isinstance(c["verdict"], str)
        for m in r["metrics"]:
            v = c[m]
            assert len(v["per_rerun"]) == 2
            assert v["mean"] == pytest.approx(np.mean(v["per_rerun"]))
            assert v["rerun_spread"] == pytest.approx(max(v["per_rerun"]) - min(v["per_rerun"]))
    assert r["lipsync_corr_reference"] == r["configs"]["reference"]["lipsync_corr"]["mean"]
    assert "tiny" in (out / "README.md").read_text()


def test_e2e_reruns_differ_by_noise_seed(e2e):
    ref = e2e[0]["results"]["configs"]["reference"]
    # different noise seeds give different streams: the identity's per-rerun means are not equal
    assert ref["identity_1s"]["rerun_spread"] > 0
    assert e2e[0]["results"]["noise_seeds"] == [0, 1]


def test_e2e_verdict_follows_the_rule(e2e):
    r = e2e[0]["results"]
    ref, c = r["configs"]["reference"], r["configs"]["fp8_ring_graphs"]
    assert ref["verdict"] == "reference"
    flagged = []
    for m in r["metrics"]:
        delta = c[m]["mean"] - ref[m]["mean"]
        thr = max(c[m]["rerun_spread"], ref[m]["rerun_spread"])
        assert c[m]["delta"] == pytest.approx(delta) and c[m]["threshold"] == pytest.approx(thr)
        assert c[m]["differs"] == (abs(delta) > thr)
        flagged += [m] if abs(delta) > thr else []
    assert (c["verdict"] == "within rerun spread") == (not flagged)
    assert all(m in c["verdict"] for m in flagged)


def test_e2e_graphs_on_cpu_say_eager_and_tp_says_skipped(e2e):
    cs = e2e[0]["results"]["configs"]
    assert cs["fp8_ring_graphs"]["effective"] == "eager (no CUDA)"
    assert cs["reference"]["effective"] == "eager"
    assert cs["fp8_ring_graphs"]["build"]["fp8_layers"] > 0
    tp = cs["fp8_ring_tp_fused"]
    assert "torchrun" in tp["skipped"] and tp["verdict"].startswith("skipped:")
    assert "lipsync_corr" not in tp


def test_e2e_ground_truth_is_the_ceiling(e2e):
    r = e2e[0]["results"]
    gt = r["configs"]["ground_truth"]
    assert gt["lipsync_corr"]["mean"] > 0.8 and gt["lipsync_offset_frames"]["mean"] == 0
    assert r["lipsync_corr_ground_truth"] == gt["lipsync_corr"]["mean"]
    assert gt["identity_1s"]["mean"] < 0.06  # the same face, just talking and moving
    # random weights do not lip-sync: the ground truth is well above the generated streams
    assert gt["lipsync_corr"]["mean"] > r["lipsync_corr_reference"] + 0.2


# ---- command line ------------------------------------------------------------------------------------


def test_cli_eval_help_and_one_line_errors(capsys):
    assert main(["eval", "--help"]) == 0
    assert "--drift-seconds" in capsys.readouterr().out
    assert main(["bench", "eval", "--help"]) == 0
    assert "--reruns" in capsys.readouterr().out
    for bad, words in (
        (["--configs", "reference,nope"], "unknown configuration"),
        (["--reruns", "1"], "--reruns must be >= 2"),
        (["--seconds", "2"], "past the end"),
        (["--drift-seconds", "0,1"], "positive seconds"),
    ):
        assert main(["eval", *bad]) == 2, bad
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: cadence eval") and words in err[0], err


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
    assert harness.metric_names((1, 10, 60))[2:] == ["identity_1s", "identity_10s", "identity_60s"]
