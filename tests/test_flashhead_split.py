"""A FlashHead clip's split (``cadence.model.flashhead_stream.ClipSplit``, recorded by ``bench pipeline`` as
``results.clip_split_ms``) and the whole-clip attention candidates (``cadence.bench.pipeline_clips``), on the CPU.

The split's phases are contiguous marks inside the session's step, so on the host clock they add up to at most
the engine's ``diffusion_ms`` for the chunk (which starts a few lines earlier, in ``Engine.submit``). Slack
below: the phases cover the step to within 10% + 10 ms (measured on the 2-core VM: ~1 ms of a ~170 ms Lite
step outside the phases; the rest of the allowance is for a busy CI machine preempting the process between
``submit``'s clock and the first mark).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from cadence.model.flashhead_stream import ClipSplit

FIX = Path(__file__).parent / "fixtures" / "flashhead" / "SoulX-FlashHead-tiny"
PHASES = [
    "audio",
    "audio_proj",
    "pass_1",
    "pass_2",
    "pass_3",
    "pass_4",
    "decode",
    "colour",
    "encode",
    "frames",
]


def test_clip_split_marks_contiguous_phases():
    s = ClipSplit("cpu")
    s.mark("ignored")  # outside a clip: nothing
    s.begin()
    time.sleep(0.01)
    s.mark("a")
    s.mark("b")
    time.sleep(0.005)
    s.mark("a")  # a phase marked twice adds up
    s.end("c")
    t0 = time.perf_counter()
    s.begin()  # begun, never ended: dropped
    (clip,) = s.take()
    assert list(clip) == ["a", "b", "c"]
    assert all(v >= 0 for v in clip.values())
    assert clip["a"] >= 15.0 - 1.0  # 10 ms + 5 ms of sleep (the clock's granularity aside)
    assert s.take() == []
    assert time.perf_counter() >= t0


def _bench(tmp_path, variant: str, size: int, *extra: str) -> dict:
    pytest.importorskip("soxr")
    pytest.importorskip("transformers")
    from cadence.bench.pipeline import main

    argv = ["--device", "cpu", "--decode-device", "same", "--no-graphs", "--shape-change-every", "0"]
    argv += ["--model", f"flashhead-{variant}", "--weights", str(FIX), "--height", str(size)]
    argv += ["--width", str(size), "--chunks", "2", "--no-prewarm", "--out-dir", str(tmp_path), *extra]
    assert main(argv) == 0
    (path,) = (tmp_path / "pipeline").glob("*.json")
    return json.loads(path.read_text())["results"]


def _check_split(res: dict) -> None:
    split = res["clip_split_ms"]
    assert res["clip_split"]["phases"] == PHASES
    for k in [*PHASES, "dit", "step", "outside", "host_copy"]:
        assert split[k] >= 0, (k, split)
    assert split["dit"] == pytest.approx(sum(split[f"pass_{i}"] for i in range(1, 5)), rel=0.05, abs=0.01)
    for row in res["per_chunk"]:
        phases = row["split"]
        assert list(phases) == PHASES and all(v >= 0 for v in phases.values()), row
        total, step = sum(phases.values()), row["diffusion_ms"]
        assert total <= step + 0.1, row  # the marks are inside the step
        assert total >= 0.9 * step - 10.0, row  # the stated slack (module docstring)


def test_bench_pipeline_records_the_clip_split_lite(tmp_path, capsys):
    res = _bench(tmp_path, "lite", 64)
    _check_split(res)
    assert res["clip_attention"]["name"] == "reference" and res["clip_attention"]["applied"]
    assert "clip split p50 (ms)" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_pipeline_records_the_clip_split_pro(tmp_path):
    """Pro's tiny Wan VAE takes ~3 s a clip on two cores: slow."""
    _check_split(_bench(tmp_path, "pro", 32))


# ---- the whole-clip attention candidates ----------------------------------------------------------------------


def _model():
    from cadence.model.flashhead import load_flashhead_model

    return load_flashhead_model(FIX / "Model_Pro", "cpu", torch.float32)


def _pass(model, seed: int = 0):
    """One model pass at 2 latent frames of 4 x 4 latents (float32)."""
    c = model.fcfg
    g = torch.Generator().manual_seed(seed)
    f, h, w = 2, 4, 4
    x = torch.randn(1, c.out_dim, f, h, w, generator=g)
    ref = torch.randn(1, c.in_dim - c.out_dim, f, h, w, generator=g)
    audio = torch.randn(
        1, 1 + c.vae_scale * (f - 1), c.audio_window, 4, c.audio_frame_width // 4, generator=g
    )
    return model(x, torch.tensor([937.5]), audio, ref)


class _Eng:
    def __init__(self, model):
        self.gen = type("Gen", (), {"model": model})()


@pytest.mark.parametrize("name, bound", [("rope", 1e-5), ("fp8", 0.02), ("fa3_fp8", 0.02)])
def test_clip_attention_candidates_match_the_reference_pass(name, bound):
    """Each candidate's CPU form against the model's own pass: ``rope`` is the same float32 rotation in real
    arithmetic (one rounding apart: 1e-5 relative); the FP8 ones quantise q, k, v to e4m3 (per token-head or per
    head), then attend by the dequantising reference: the whole pass within 2% (relative L2; measured 0.19% and 0.28%; their attention
    alone is held to the registry's FP8_BUDGET, 8%, when applied)."""
    from cadence.bench.pipeline_clips import apply_clip_attention

    model = _model()
    want = _pass(model)
    rec = apply_clip_attention(_Eng(model), name)
    assert rec["applied"], rec
    assert model.clip_attention is not None
    got = _pass(model)
    err = float((got - want).norm() / want.norm())
    assert err < bound, (name, err)
    if name != "rope":
        assert err > 1e-6  # the quantisation is really on this path
        assert 0 < rec["check_error"] <= rec["budget"]


@pytest.mark.parametrize("name", ["cudnn", "fa3"])
def test_clip_attention_candidates_that_cannot_run_fall_back(name, caplog):
    """A candidate that cannot run here (the CPU) is not applied: one log line, the reference kept, the why in
    the record."""
    from cadence.bench.pipeline_clips import apply_clip_attention

    model = _model()
    with caplog.at_level("WARNING", logger="cadence.bench"):
        rec = apply_clip_attention(_Eng(model), name)
    assert not rec["applied"] and rec["why"]
    assert model.clip_attention is None
    assert len([r for r in caplog.records if "not applied" in r.getMessage()]) == 1


@pytest.mark.parametrize("per", ["token", "head"])
def test_quantize_round_trip(per):
    """e4m3 keeps 3 mantissa bits: every dequantised value within 2^-4 of its own magnitude, plus the scale's
    subnormal step for the smallest; the largest magnitude per token-head (or head) lands on 448."""
    from cadence.bench.pipeline_clips import quantize

    x = torch.randn(64, 3, 16, generator=torch.Generator().manual_seed(1))
    q, s = quantize(x, per)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, 64, 16)
    back = q.float() * (s[..., None] if per == "token" else s[:, None, None])
    xh = x.transpose(0, 1)
    step = (s[..., None] if per == "token" else s[:, None, None]) * 2.0**-9  # e4m3's subnormal spacing
    assert ((back - xh).abs() <= xh.abs() * 2.0**-4 + step).all()
    top = q.float().abs().amax(dim=-1) if per == "token" else q.float().abs().amax(dim=(1, 2))
    assert torch.all(top == 448)


def test_clip_attention_for_a_model_without_the_seam_is_one_error(capsys):
    from cadence.bench.pipeline import main

    argv = ["--preset", "tiny", "--device", "cpu", "--chunks", "2", "--no-prewarm", "--no-record"]
    assert main([*argv, "--shape-change-every", "0", "--clip-attention", "fp8"]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: --clip-attention is for clip streams (FlashHead), not tiny"
    ]


def test_clip_encode_compile_matches_the_eager_encoder():
    """``--clip-encode compile`` on Pro's codec (the tiny Wan 2.1 VAE): the guarded, compiled encoder (traced by
    ``aot_eager`` here: no C++ compiler needed) gives the eager encoder's latents (float32: 1e-5 relative; the
    same ops, channels-last convs may sum in another order)."""
    from cadence.bench.pipeline_clips import apply_clip_encode
    from cadence.model.flashhead_stream import WanClipCodec
    from cadence.model.vae import load_wan_vae

    vae = load_wan_vae(FIX / "VAE_Wan" / "Wan2.1_VAE.pth", "cpu", torch.float32)
    codec = WanClipCodec(vae)
    video = torch.rand(3, 5, 16, 16, generator=torch.Generator().manual_seed(2)) * 2 - 1
    want = codec.encode(video)
    eng = _Eng(None)
    eng.gen.clip_codec = codec
    rec = apply_clip_encode(eng, "compile", backend="aot_eager")
    assert rec["applied"], rec
    got = codec.encode(video)
    guarded = vae.encoder.forward
    assert not guarded.failed and len(guarded.seen) == 2, rec["report"].notes  # both calls compiled
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_clip_encode_without_a_wan_encoder_is_not_applied():
    from cadence.bench.pipeline_clips import apply_clip_encode

    eng = _Eng(None)
    eng.gen.clip_codec = object()  # e.g. Lite's LTX codec: no Wan encoder
    rec = apply_clip_encode(eng, "compile")
    assert not rec["applied"] and "Wan VAE encoder" in rec["why"]


def test_clip_attention_rope_takes_the_blocks_compiled_rope():
    """With the blocks' elementwise ops compiled (``apply_compile``; ``aot_eager`` here), ``rope`` uses their
    compiled ``apply_rope`` (``apply_rope_real`` traced), not an eager copy: the same pass to 1e-5."""
    from cadence.bench.pipeline_clips import apply_clip_attention
    from cadence.runtime.compile import apply_compile

    model = _model()
    want = _pass(model)
    assert apply_compile(model, backend="aot_eager").enabled
    rec = apply_clip_attention(_Eng(model), "rope")
    assert rec["applied"] and rec["note"] == "RoPE compiled", rec
    got = _pass(model)
    assert float((got - want).norm() / want.norm()) < 1e-5
