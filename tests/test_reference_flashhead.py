"""The FlashHead reference harness (scripts/reference_flashhead_bench.py), which times SoulX-FlashHead's own
streaming loop for the side-by-side of docs/models.md, on this CPU at its ``--small`` size.

It imports the authors' code from ``.ref/SoulX-FlashHead`` (``ONLY=SoulX-FlashHead bash
scripts/reference_checkouts.sh`` makes it from a mirror; it is never committed) and needs the packages their
code imports (einops, diffusers, transformers, torchvision, loguru, PyYAML): both tests skip, saying which is
missing, where either is absent (CI has no checkout). ``FLASHHEAD_REF_PYTHONPATH`` names an extra folder for
those packages (a ``pip install --target`` folder). Run in subprocesses: the harness stubs modules
(xfuser, imageio, librosa, ...) process-wide."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / ".ref" / "SoulX-FlashHead"
HARNESS = ROOT / "scripts" / "reference_flashhead_bench.py"
PACKAGES = ("einops", "diffusers", "transformers", "torchvision", "loguru", "yaml")


def _env() -> dict:
    extra = [os.environ.get("FLASHHEAD_REF_PYTHONPATH", ""), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in extra if p), PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def env():
    if not (REF / "flash_head" / "inference.py").is_file():
        pytest.skip(
            f"no reference checkout at {REF} (ONLY=SoulX-FlashHead bash scripts/reference_checkouts.sh)"
        )
    names = " ".join(PACKAGES)
    probe = f"import importlib.util as u; print(*(n for n in {names!r}.split() if u.find_spec(n) is None))"
    r = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True, text=True, timeout=60)
    if r.returncode or r.stdout.strip():
        pytest.skip(f"the reference's packages are missing here: {r.stdout.strip() or r.stderr[-300:]}")
    return _env()


@pytest.mark.slow
def test_their_wav2vec2_subclass_under_this_transformers_gives_the_fixture_features(env):
    """The harness runs their 4.x-era ``Wav2Vec2Model`` subclass under the GPU machine's transformers 5 with the
    hidden states handed back by forward hooks (reference_flashtalk_bench.hidden_states_shim): the features
    must equal, exactly, what their ``preprocess_audio`` gave under transformers 4.57.3 when the parity fixture
    was made (tests/fixtures/flashhead: same tiny wav2vec2 folder, same signal, float32 on the CPU)."""
    script = textwrap.dedent(
        f"""
        import sys, numpy as np, torch
        sys.path[:0] = [{str(ROOT / "scripts")!r}, {str(ROOT / "scripts/fixtures")!r}]
        import reference_flashhead_bench as rb
        from reference_flashtalk_bench import hidden_states_shim
        from transformers import Wav2Vec2FeatureExtractor
        ref = rb.import_reference(rb.Path({str(REF)!r}).resolve(), "cpu")
        fix = rb.Path({str(ROOT / "tests/fixtures/flashhead")!r})
        data = torch.load(fix / "data.pt", weights_only=False)
        p = ref.fp.FlashHeadPipeline.__new__(ref.fp.FlashHeadPipeline)
        p.device = "cpu"
        p.audio_encoder = ref.fw.Wav2Vec2Model.from_pretrained(str(fix / "wav2vec2-tiny"), local_files_only=True)
        p.wav2vec_feature_extractor = Wav2Vec2FeatureExtractor.from_pretrained(str(fix / "wav2vec2-tiny"))
        hidden_states_shim(p.audio_encoder, ref.shims)
        speech = data["pcm"].numpy().astype(np.float32) / 32768
        got = p.preprocess_audio(speech[: data["wav2vec2"]["samples"]])
        want = data["wav2vec2"]["features"]
        print("RESULT", tuple(got.shape) == tuple(want.shape), (got - want).abs().max().item())
        """
    )
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-3000:]
    _, same_shape, diff = line[0].split()
    assert same_shape == "True" and float(diff) == 0.0, line


@pytest.mark.slow
@pytest.mark.parametrize("variant,new,motion", [("pro", 28, 5), ("lite", 24, 9)])
def test_the_small_run_drives_their_streaming_loop(env, tmp_path, variant, new, motion):
    """``--small --eager``: their pipeline, tiny, on this CPU (~20-50 s each here): a warm-up chunk, then a timed
    stream of 2 chunks; every chunk has their 4 passes, a decode and a motion encode, and delivers the 33-frame
    clip less the motion frames their get_pipeline computed; the JSON has the reference schema's keys."""
    out = tmp_path / f"flashhead-{variant}.json"
    cmd = [sys.executable, str(HARNESS), "--ref", str(REF), "--variant", variant, "--small", "--eager"]
    cmd += ["--clips", "2", "--warmup-clips", "1", "--repeats", "2", "--out", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["reference"] == "Soul-AILab/SoulX-FlashHead" and s["variant"] == variant and s["small"]
    assert s["reference_commit"] == (REF / "COMMIT").read_text().strip()
    assert s["compile"] is None and s["dtype"] == "float32" and s["finite"]
    g = s["geometry"]
    assert (g["frame_num"], g["motion_frames"], g["new_frames"], g["steps"]) == (33, motion, new, 4)
    assert [len(r["blocks"]) for r in s["runs"]] == [1, 2]
    for run in s["runs"]:
        assert run["frames"] == new * len(run["blocks"]) and run["prepare_ms"] > 0
        for b in run["blocks"]:
            assert b["frames"] == new and b["passes"] == 4, b
            assert b["decode_ms"] > 0 and b["encode_ms"] > 0 and b["audio_ms"] > 0, b
            assert b["wall_ms"] >= b["run_pipeline_ms"] >= b["denoise_ms"], b
    assert s["fps_steady"] == pytest.approx(new / (s["block_ms_median_steady"] / 1e3))
    assert 0 < s["ttff_ms"] < s["ttff_with_prepare_ms"]
    assert len(s["block_ms"]) == len(s["run_pipeline_ms"]) == len(s["decode_ms"]) == 2
