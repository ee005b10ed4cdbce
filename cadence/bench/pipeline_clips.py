"""`bench pipeline` on a clip stream (FlashHead): where a clip's time goes, and the candidate fast paths of its
whole-clip self-attention (issue 35; arithmetic and predictions: docs/perf/flashhead/NOTES.md).

**The split.** Before the timed stream the benchmark sets the generator's ``clip_split``
(``cadence.model.flashhead_stream.ClipSplit``): the session marks the end of each phase of every clip
(``audio``, ``audio_proj``, ``pass_1`` .. ``pass_4``, ``decode``, ``colour``, ``encode``, ``frames``), with
CUDA events on the step's stream (no host sync inside the step; read after the stream) or the host clock on
the CPU. :func:`split_summary` gives the JSON's ``clip_split_ms``: the median of each phase over the steady
clips, ``dit`` (the passes together), ``step`` (the engine's ``diffusion_ms``: the whole step, which for a clip
stream is the whole clip), ``outside`` (step minus the phases: the step's own lines before the first mark and
after the last) and ``host_copy`` (the engine's decode stage copying the frames to the host). A session
without the hook (FlashTalk's) has no split.

**The candidates** (``--clip-attention NAME``, recorded in the JSON's ``clip_attention``): the DiT's
whole-clip self-attention (:attr:`cadence.model.flashhead.FlashHeadDiT.clip_attention`; its reference is the
complex float32 RoPE, then torch SDPA's default dispatch), each with the RoPE first:

* ``rope``: the RoPE as the blocks' compiled ``ElementwiseOps.apply_rope`` (``apply_rope_real``, one pass,
  when ``--compile`` applied; otherwise ``apply_rope_real`` eager), then SDPA as before;
* ``cudnn``: ``rope`` + SDPA pinned to its cuDNN backend;
* ``fa3``: ``rope`` + FlashAttention-3 bf16 (``cadence.kernels.fa3_adapter``, the optional wheel);
* ``fp8``: the RoPE (``apply_rope_real``) and an FP8 e4m3 quantisation per (token, head) in one compiled
  function, then Cadence's Triton FP8 flash attention (``cadence.kernels.ring_attention.ring_attention``, V^T);
* ``fa3_fp8``: the same with one scale per head, then FA3's FP8 forward.

Each is checked once when applied against float32 attention on a small random input (budget: the registry's
``BF16_BUDGET`` / ``FP8_BUDGET``); one that cannot run or misses its budget is left out with one log line, and
the JSON says why. On the CPU the FP8 ones run their reference form (the same quantisation, then the
dequantising PyTorch attention ``ring_attention_reference``): what tests/test_flashhead_split.py checks.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from cadence.bench.common import median

log = logging.getLogger("cadence.bench")

#: ``--clip-attention`` choices (module docstring); 'reference' is the model's own path.
CLIP_ATTENTION = ("reference", "rope", "cudnn", "fa3", "fp8", "fa3_fp8")
#: The phases a FlashHead clip marks, in order (``cadence.model.flashhead_stream.ClipSplit``).
PASS_PREFIX = "pass_"


# ---- the split ---------------------------------------------------------------------------------------------
def attach_split(eng):
    """A fresh ``ClipSplit`` on the engine's generator (its session marks every clip's phases), or None when
    the session has no such hook."""
    gen = eng.gen
    if not hasattr(gen, "clip_split"):
        return None
    from cadence.model.flashhead_stream import ClipSplit

    gen.clip_split = ClipSplit(gen.model.device)
    return gen.clip_split


def detach_split(eng) -> None:
    if hasattr(eng.gen, "clip_split"):
        eng.gen.clip_split = None


def split_summary(clips: list[dict], outs: list, skip: int) -> tuple[dict, dict]:
    """(``clip_split_ms``: per phase the median over the steady clips, with ``dit``, ``step``, ``outside``,
    ``host_copy``; ``clip_split``: how it was taken). ``clips``: ``ClipSplit.take()`` of the stream whose
    chunks are ``outs`` (one clip per chunk, in order); ``skip``: the non-steady chunks at the start."""
    if len(clips) != len(outs):
        raise RuntimeError(f"the clip split has {len(clips)} clips for {len(outs)} chunks")
    idx = list(range(skip, len(outs))) if len(outs) - skip >= 2 else list(range(len(outs)))
    names = list(dict.fromkeys(n for i in idx for n in clips[i]))
    res = {n: median([clips[i].get(n, 0.0) for i in idx]) for n in names}
    passes = [n for n in names if n.startswith(PASS_PREFIX)]
    res["dit"] = median([sum(clips[i].get(n, 0.0) for n in passes) for i in idx])
    step = [outs[i].timings.diffusion_ms for i in idx]
    res["step"] = median(step)
    res["in_phases"] = median([sum(clips[i].values()) for i in idx])
    res["outside"] = median([s - sum(clips[i].values()) for s, i in zip(step, idx)])
    res["host_copy"] = median([outs[i].timings.host_copy_ms for i in idx])
    meta = {"clips": len(idx), "phases": names, "first_clip": clips[0] if clips else None}
    return {k: round(v, 3) for k, v in res.items()}, meta


def split_row(s: dict) -> tuple[str, str]:
    """The printed row of a ``clip_split_ms``."""
    passes = [k for k in s if k.startswith(PASS_PREFIX)]
    parts = [f"{k} {s[k]:.1f}" for k in s if k not in passes and k not in ("dit", "step", "in_phases")]
    keys = [k for k in s if k not in passes]
    at = keys.index("audio_proj") + 1 if "audio_proj" in keys else 0
    parts.insert(at, f"dit {s['dit']:.1f} ({' / '.join(f'{s[k]:.1f}' for k in passes)})")
    return ("clip split p50 (ms)", f"step {s['step']:.1f} = " + ", ".join(parts))


# ---- the candidates --------------------------------------------------------------------------------------
def _rope_fn(model):
    """The blocks' RoPE in one pass: their compiled ``apply_rope`` (``apply_rope_real``) when compile applied,
    else ``apply_rope_real`` eager."""
    from cadence.model.layers import PLAIN_OPS
    from cadence.model.rope import apply_rope_real

    rope = model.blocks[0].ops.apply_rope  # a fused-quantisation wrapper hands this to its compiled base
    if rope is not PLAIN_OPS.apply_rope:
        return rope, "compiled"
    return apply_rope_real, "eager"


def quantize(x: torch.Tensor, per: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H, D] -> (e4m3 [H, N, D], float32 scales [H, N] (``per`` 'token') or [H] ('head')): value =
    stored * scale, the largest magnitude of each token-head (or head) at 448."""
    from cadence.kernels.ring_attention import FP8, FP8_MAX

    xh = x.transpose(0, 1).float()
    amax = xh.abs().amax(dim=-1) if per == "token" else xh.abs().amax(dim=(1, 2))
    s = amax.clamp_min(1e-12) / FP8_MAX
    div = s[..., None] if per == "token" else s[:, None, None]
    return (xh / div).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def _prep_fp8(rope, per: str, v_transposed: bool):
    """``(q, k, v [1, N, H, D], cos, sin) -> (q8, qs, k8, ks, v8, vs)``: the RoPE on q and k, each quantised
    (:func:`quantize`), V^T [H, D, N] where ``v_transposed``."""

    def prep(q, k, v, cos, sin):
        q8, qs = quantize(rope(q, cos, sin)[0], per)
        k8, ks = quantize(rope(k, cos, sin)[0], per)
        v8, vs = quantize(v[0], per)
        return q8, qs, k8, ks, (v8.transpose(1, 2).contiguous() if v_transposed else v8), vs

    return prep


class _Compiled:
    """``torch.compile`` of a pure function on CUDA (static shapes), the plain function on the CPU or once
    compiling has failed (one log line)."""

    def __init__(self, fn, name: str, cuda: bool):
        self.fn, self.name, self.compiled = fn, name, None
        if cuda:
            try:
                self.compiled = torch.compile(fn, dynamic=False)
            except Exception as e:  # pragma: no cover - no compiler
                log.info("clip attention: %s stays eager (%s)", name, e)

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as e:  # pragma: no cover - a compiler failure at the first call
                log.info("clip attention: %s stays eager (%s: %s)", self.name, type(e).__name__, e)
                self.compiled = None
        return self.fn(*args)


def make_clip_attention(name: str, model, cuda: bool):
    """The attention function of candidate ``name`` (:data:`CLIP_ATTENTION`, not 'reference') and how its
    parts run (a note). ``cuda``: the kernels' form; otherwise the FP8 candidates' reference form."""
    from cadence.model.attention import attention

    rope, how = _rope_fn(model)
    if name in ("rope", "cudnn", "fa3"):
        if name == "cudnn" and not cuda:
            raise RuntimeError("SDPA's cuDNN backend needs CUDA")

        def attend(q, k, v, cos, sin):
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            if name == "rope":
                return attention(q, k, v)
            if name == "cudnn":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    o = F.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                    )
                return o.transpose(1, 2).flatten(2)
            return _fa3(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)).flatten(2)

        return attend, f"RoPE {how}"
    per = "token" if name == "fp8" else "head"
    # the plain real-arithmetic RoPE inside this one compiled function (not the blocks' compiled op: a compiled
    # op with its own compile gate does not nest in another trace), so inductor fuses rotation and quantisation
    from cadence.model.rope import apply_rope_real

    prep = _Compiled(
        _prep_fp8(apply_rope_real, per, v_transposed=name == "fp8"), f"{name} RoPE + quantisation", cuda
    )

    def attend_fp8(q, k, v, cos, sin):
        q8, qs, k8, ks, v8, vs = prep(q, k, v, cos, sin)
        n = q8.shape[1]
        if not cuda:
            from cadence.kernels.ring_attention import ring_attention_reference

            out = ring_attention_reference(q8, qs, k8, ks, v8, vs, n, v_transposed=name == "fp8")
            return out.to(q.dtype).flatten(1)[None]
        nv = torch.full((1,), n, dtype=torch.int32, device=q.device)
        if name == "fp8":
            from cadence.kernels.ring_attention import ring_attention

            out = ring_attention(q8, qs, k8, ks, v8, vs, nv, v_transposed=True, out_dtype=q.dtype)
            return out.flatten(1)[None]
        return _fa3(q8, k8, v8, nv, qs, ks, vs).flatten(2).to(q.dtype)

    return attend_fp8, f"RoPE + quantisation {'compiled' if cuda else 'eager'}" + (
        "" if cuda else ", attention by the dequantising reference (CPU)"
    )


def _fa3(q, k, v, nv=None, qs=None, ks=None, vs=None):
    """FA3 over q, k, v [H, N, D] (bf16, or e4m3 with [H] scales) -> [1, N, H, D]."""
    from cadence.kernels import fa3_adapter

    if nv is None:
        nv = torch.full((1,), k.shape[1], dtype=torch.int32, device=q.device)
    return fa3_adapter.attend(q, k, v, nv, q_descale=qs, k_descale=ks, v_descale=vs)


def check_clip_attention(fn, heads: int, head_dim: int, device, dtype, tokens: int = 256) -> float:
    """Relative L2 error of ``fn`` against float32 attention (the complex RoPE, then softmax) on N(0, 1) q,
    k, v [1, tokens, heads, head_dim] in ``dtype`` with random angles."""
    from cadence.model.rope import apply_rope

    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, tokens, heads, head_dim, generator=g) for _ in range(3))
    ang = torch.rand(tokens, head_dim // 2, generator=g) * 2 * math.pi
    cos, sin = ang.cos(), ang.sin()
    x = [t.to(device, dtype) for t in (q, k, v)]
    out = fn(*x, cos.to(device), sin.to(device)).float().cpu()
    qf, kf = apply_rope(x[0].float().cpu(), cos, sin), apply_rope(x[1].float().cpu(), cos, sin)
    ref = F.scaled_dot_product_attention(
        qf.transpose(1, 2), kf.transpose(1, 2), x[2].float().cpu().transpose(1, 2)
    )
    ref = ref.transpose(1, 2).flatten(2)
    return float((out - ref).norm() / ref.norm())


def apply_clip_attention(eng, name: str) -> dict:
    """Candidate ``name`` on the engine's FlashHead DiT (before its warm-up: the graphs capture it), checked
    first (:func:`check_clip_attention`); what applied, for the JSON (``applied`` false with ``why``)."""
    from cadence.kernels.attention_registry import BF16_BUDGET, FP8_BUDGET

    model = eng.gen.model
    rec = {"name": name, "applied": False}
    if name == "reference":
        return dict(rec, applied=True, note="complex float32 RoPE + torch SDPA (the model's own)")
    if not hasattr(type(model), "clip_attention"):
        return dict(rec, why=f"{type(model).__name__} has no whole-clip attention seam")
    cuda = model.device.type == "cuda"
    budget = FP8_BUDGET if "fp8" in name else BF16_BUDGET
    try:
        fn, note = make_clip_attention(name, model, cuda)
        heads = model.blocks[0].self_attn.heads
        err = check_clip_attention(fn, heads, model.fcfg.dim // heads, model.device, model.dtype)
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        log.warning("clip attention %s: not applied (%s); the model keeps its reference", name, why)
        return dict(rec, why=why)
    if not math.isfinite(err) or err > budget:
        log.warning("clip attention %s: not applied (error %.3g > %.3g)", name, err, budget)
        return dict(rec, why=f"relative error {err:.3g} > {budget}", check_error=err)
    model.clip_attention = fn
    return dict(rec, applied=True, note=note, check_error=round(err, 5), budget=budget)


# ---- the motion frames' encode -----------------------------------------------------------------------------
#: ``--clip-encode`` choices: 'reference' (the Wan encoder eager, as built) or 'compile' (channels-last +
#: ``torch.compile`` of ``encoder.forward``, the Wan decoder's ``compile`` mode applied to the encoder).
CLIP_ENCODE = ("reference", "compile")


def apply_clip_encode(eng, name: str, backend: str = "inductor") -> dict:
    """``--clip-encode`` on the clip codec's Wan VAE encoder (Pro's; the motion frames' re-encode every clip):
    what applied, for the JSON. 'compile' wraps ``encoder.forward`` in ``cadence.runtime.vae_fast``'s guarded
    compile (falls back to eager for good, one log line, the causal memory restored, when a call raises; on
    the CPU channels-last only, as the decoder's modes); ``backend``: torch.compile's (tests: 'aot_eager',
    which also runs on the CPU)."""
    rec = {"name": name, "applied": name == "reference"}
    if name == "reference":
        return rec
    codec = getattr(eng.gen, "clip_codec", None)
    vae = getattr(codec, "vae", None)
    if vae is None or not hasattr(vae, "encoder") or not hasattr(vae, "enc_slots"):
        return dict(rec, why="the clip codec has no Wan VAE encoder (Pro's codec only)")
    from cadence.runtime.vae_fast import (
        DecoderFastReport,
        _GuardedForward,
        _raise_compile_limits,
        channels_last,
    )

    enc = vae.encoder
    channels_last(enc)
    channels_last(vae.quant_conv)
    rep = DecoderFastReport("compile")
    if (
        backend == "inductor" and not enc.conv_in.weight.is_cuda
    ):  # as the decoder's modes: compile on CUDA only
        log.info("clip encode compile needs CUDA: channels-last only")
        return dict(rec, applied=True, note="channels_last only (compile needs CUDA)", report=rep)
    try:
        _raise_compile_limits()
        guarded = _GuardedForward(enc, enc.forward, rep)
        if backend != "inductor":
            guarded.compiled = torch.compile(guarded.eager, dynamic=False, backend=backend)
        enc.forward = guarded
    except Exception as e:  # pragma: no cover - no dynamo here
        log.warning("clip encode compile unavailable (%s): eager", e)
        return dict(rec, why=f"{type(e).__name__}: {e}")
    return dict(rec, applied=True, note="channels_last + torch.compile of encoder.forward", report=rep)


def add_clip_flags(p) -> None:
    """``bench pipeline``'s clip-stream candidates: ``--clip-attention``, ``--clip-encode``."""
    p.add_argument(
        "--clip-attention",
        default="reference",
        choices=CLIP_ATTENTION,
        help="a clip stream's (FlashHead's) whole-clip self-attention: a candidate fast path "
        "(cadence.bench.pipeline_clips; default: the model's own, complex RoPE + SDPA)",
    )
    p.add_argument(
        "--clip-encode",
        default="reference",
        choices=CLIP_ENCODE,
        help="a clip stream's motion-frame re-encode (FlashHead Pro's Wan encoder): 'compile' = channels-last + "
        "torch.compile of the encoder (cadence.bench.pipeline_clips; default: eager, as built)",
    )
