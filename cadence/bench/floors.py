"""What one tensor-parallel rank's chunk step must at least cost, part by part (``cadence bench step``).

Count first, then time: for each part of the split the step benchmark reports, the work a rank does in one
chunk (all passes, all layers) and the time that work takes at the ceilings measured on an H200
(docs/benchmarks.md), so that every measured part stands beside its floor:

============== ============================================================== =========================
part           work counted per rank                                           at
============== ============================================================== =========================
linears        2 M K N of every linear: the block linears' 1/N shards, the    1200 TFLOP/s FP8 GEMM
               replicated ones (patch embedding, head, embedders) whole;      (790 bf16)
               the audio K/V and embedder once per chunk, the time MLP /
               projection not at all (kept across chunks: runtime.chunk)
attention      4 q kv d of self / cross / audio attention over the rank's     1000 TFLOP/s FP8 K/V
               heads                                                           (540 bf16, cuDNN)
quantisation   every FP8 linear's activation quantised in front of it:        4.2 TB/s (HBM, read +
               read bf16, write e4m3 (3 B an element; SP: the gathered        write: docs/benchmarks.md's
               column inputs are quantised on the rank's P rows only)          device copy)
elementwise    the fused per-token ops between them (the first adaLN 4 B,     4.2 TB/s
               the last gated residual 6 B, each residual add with the norm
               after it 8 B: self, cross (+ audio); on the rank's rows:
               all N, or P under SP), GELU on fc1's output (4 B, all tokens),
               the sharded q / k RMS norms (6 B, all tokens, the rank's heads)
cache          the ring write of the chunk's K and V (read bf16, write bf16 /  4.2 TB/s
               e4m3, the rank's heads)
comm           the bytes a rank moves over its links (the collective list's   450 GB/s a direction per
               bus bytes, cadence.parallel.emulate.bus_factor)                 H200 (NVLink 4 spec, 18
                                                                               links: not measured)
============== ============================================================== =========================

Bytes are those of a kernel that reads its inputs and writes its output once in bf16 (the compiled ops of
``cadence.runtime.compile`` come close: 6.2 us for one RMSNorm + modulation at 748 x 8192, ~the 24.5 MB /
4.2 TB/s = 5.8 us it must move). The floor of the whole step is the sum: nothing overlaps in it.
"""

from __future__ import annotations

import math
from collections import defaultdict

from cadence.config import CadenceConfig

HBM_BYTES_S = 4.2e12  # docs/benchmarks.md: device copy 4.2 TB/s (read + write), one H200
NVLINK_BYTES_S = 450e9  # H200 NVLink 4, one direction (18 links x 25 GB/s): the spec, not a measurement
TFLOPS = {
    "fp8_gemm": 1200.0,
    "bf16_gemm": 790.0,
    "fp8_attn": 1000.0,
    "bf16_attn": 540.0,
}  # = bench.common.CEILING


def chunk_flops(cfg: CadenceConfig) -> dict[str, float]:
    """FLOPs of one chunk step (all passes): linear layers and attention, counted from the shapes."""
    m, s = cfg.model, cfg.stream
    d, t = m.dim, cfg.tokens_per_chunk
    frames = s.latent_frames_per_chunk // m.patch[0]
    a = m.audio_tokens_per_frame * frames
    passes = s.passes + (1 if s.commit == "clean_pass" else 0)
    lin = attn = once = 0.0
    for i in range(m.num_layers):
        lin += 2 * t * d * (3 * d + d)  # qkv + out
        lin += 2 * t * d * (2 * d)  # cross q + out (text K/V once per session: not per chunk)
        lin += 2 * t * d * m.ffn_dim * 2  # ffn in + out
        attn += 4 * t * cfg.kv_tokens * d  # self: QK^T and PV
        attn += 4 * t * m.text_len * d  # cross
        if m.has_audio(i):
            lin += 2 * t * d * 2 * d  # audio q/out
            once += 2 * a * d * 2 * d  # audio K/V: once per chunk (cadence.runtime.chunk)
            attn += 4 * t * m.audio_tokens_per_frame * d
    patch = m.in_channels * math.prod(m.patch)
    lin += 2 * t * patch * d * 2  # patch embed, head (the time MLP / projection: kept across chunks)
    if m.audio_every:
        once += 2 * a * (m.audio_dim * d + d * d)
    lin = lin * passes + once
    return {"linear": lin, "attention": attn * passes, "total": lin + attn * passes}


def _passes(cfg: CadenceConfig) -> int:
    return cfg.stream.passes + (1 if cfg.stream.commit == "clean_pass" else 0)


def _audio_tokens(cfg: CadenceConfig) -> tuple[int, int]:
    """(audio tokens a latent frame, audio tokens of the chunk)."""
    m = cfg.model
    frames = cfg.stream.latent_frames_per_chunk // m.patch[0]
    return m.audio_tokens_per_frame, m.audio_tokens_per_frame * frames


def rank_flops(cfg: CadenceConfig, tp: int) -> dict[str, float]:
    """FLOPs of one chunk on one rank of `tp`: linear (block shards + replicated parts) and attention."""
    m, n = cfg.model, max(tp, 1)
    d, t, kv = m.dim, cfg.tokens_per_chunk, cfg.kv_tokens
    per_frame, a = _audio_tokens(cfg)
    ctx = m.audio_context_dim if m.audio_arch == "multitalk" else d
    lin = attn = once = 0.0
    for i in range(m.num_layers):
        lin += 2 * t * d * (4 * d) / n + 2 * t * d * (2 * d) / n + 2 * t * d * m.ffn_dim * 2 / n
        attn += 4 * t * kv * d / n + 4 * t * m.text_len * d / n
        if m.has_audio(i):
            lin += 2 * t * d * 2 * d / n
            once += 2 * a * ctx * 2 * d / n  # the audio K/V: once per chunk
            attn += 4 * t * per_frame * d / n
    patch = m.in_channels * math.prod(m.patch)
    lin += 2 * t * patch * d * 2  # patch embedding, head: every rank (the time MLP / projection: kept)
    if m.audio_every:
        once += 2 * a * (m.audio_dim * d + d * d)
    p = _passes(cfg)
    return {"linear": lin * p + once, "attention": attn * p}


def rank_bytes(
    cfg: CadenceConfig, tp: int, sp: bool, fp8: bool, kv_fp8: bool, el: int = 2
) -> dict[str, float]:
    """HBM bytes of one chunk on one rank: elementwise ops, activation quantisation (FP8), cache write."""
    from cadence.parallel.sp import rows_per_rank

    m, n = cfg.model, max(tp, 1)
    d, f, t = m.dim, m.ffn_dim, cfg.tokens_per_chunk
    rows = rows_per_rank(t, n) if sp and n > 1 else t  # the per-token work's rows on this rank
    _, a = _audio_tokens(cfg)
    ctx = m.audio_context_dim if m.audio_arch == "multitalk" else d
    ew = quant = cache = once = 0.0
    for i in range(m.num_layers):
        audio = m.has_audio(i)
        branches = 2 if audio else 1  # cross (+ audio) attention: affine norm + residual add
        # the first adaLN (read x, write h), the last gated residual (read x, y; write x) and, per residual add
        # before a norm (self-attention's, each cross / audio attention's), the add and the norm as one op:
        # read x, y; write x, h (ElementwiseOps' pairs; unfused these are 3 + 2 bytes an element each)
        ew += rows * d * el * (2 + 3 + (1 + branches) * 4)
        ew += t * f / n * el * 2  # GELU
        ew += (
            t * d / n * el * 3 * (3 + (1 if audio else 0))
        )  # sharded q/k norms: self q, k, cross q (+ audio q)
        # FP8 inputs: qkv, cross q, fc1 (+ audio q) on the rows (SP quantises before the gather); the
        # out projections (self, cross (+ audio)) and fc2 on every token's shard; the audio K/V on its tokens
        k = 1 if audio else 0
        q_elems = rows * d * (3 + k) + t * d / n * (2 + k) + t * f / n
        quant += q_elems * (el + 1)
        once += k * a * ctx * (el + 1)  # the audio K/V's input: once per chunk
        cache += 2 * t * d / n * (el + (1 if kv_fp8 else el))
    p = _passes(cfg)
    return {"elementwise": ew * p, "quant": (quant * p + once if fp8 else 0.0), "cache": cache * p}


def floors_ms(
    cfg: CadenceConfig, tp: int, sp: bool, fp8: bool, kv_fp8: bool, comm_bus_bytes: float = 0.0
) -> dict[str, float]:
    """Floor per part (ms per chunk, one rank) and their sum ('step')."""
    fl = rank_flops(cfg, tp)
    by = rank_bytes(cfg, tp, sp, fp8, kv_fp8)
    out = {
        "linear": fl["linear"] / (TFLOPS["fp8_gemm" if fp8 else "bf16_gemm"] * 1e12) * 1e3,
        "attention": fl["attention"] / (TFLOPS["fp8_attn" if kv_fp8 else "bf16_attn"] * 1e12) * 1e3,
        "quant": by["quant"] / HBM_BYTES_S * 1e3,
        "elementwise": by["elementwise"] / HBM_BYTES_S * 1e3,
        "cache": by["cache"] / HBM_BYTES_S * 1e3,
        "comm": comm_bus_bytes / NVLINK_BYTES_S * 1e3,
    }
    out["step"] = sum(out.values())
    return out


def comm_bus_bytes(summary: list[dict], world: int) -> float:
    """Bytes a rank moves over its links for a per-chunk collective list (``CollectiveLog.summary``)."""
    from cadence.parallel.emulate import bus_factor

    return sum(c["nbytes"] * c["count"] * bus_factor(c["kind"], c["algo"], world) for c in summary)


def _per_layer_work(cfg: CadenceConfig, tp: int, sp: bool, fp8: bool, kv_fp8: bool, el: int) -> dict:
    """Work of the per-layer parts of :data:`cadence.bench.step_profile.PARTS`, one chunk, one rank, summed
    over the model's layers and passes: part -> (amount, 'flop' | 'byte')."""
    from cadence.parallel.sp import rows_per_rank

    m, n = cfg.model, max(tp, 1)
    d, f, t, kv = m.dim, m.ffn_dim, cfg.tokens_per_chunk, cfg.kv_tokens
    rows = rows_per_rank(t, n) if sp and n > 1 else t
    per_frame, a = _audio_tokens(cfg)
    ctx = m.audio_context_dim if m.audio_arch == "multitalk" else d
    w: dict = defaultdict(float)
    for i in range(m.num_layers):
        audio = m.has_audio(i)
        branches = 2 if audio else 1
        w["linear"] += 2 * t * d * (4 * d + 2 * d + 2 * m.ffn_dim) / n
        w["attention"] += 4 * t * kv * d / n
        w["cross_attention"] += 4 * t * m.text_len * d / n
        if audio:
            w["linear"] += 2 * t * d * 2 * d / n
            w["linear_once"] += 2 * a * ctx * 2 * d / n  # the audio K/V: once per chunk
            w["audio_attention"] += 4 * t * per_frame * d / n
        # the chunk's q, k and v through RoPE (q, k) into the ring / the query scratch: read bf16, write the store
        w["cache"] += 3 * t * d / n * (el + (1 if kv_fp8 else el))
        w["rope"] += 2 * t * d / n * el * 2  # q and k rotated on the whole-sequence path: read + write
        # q/k norm sites on the chunk's tokens: self q, k, cross q (+ the audio q where that attention has q/k
        # norms: not InfiniteTalk's); split over ranks a norm reads its input twice (local sum, then scaling)
        sites = 3 + (1 if audio and m.audio_arch != "multitalk" else 0)
        w["qk_norm"] += t * d / n * el * (3 if n > 1 else 2) * sites
        w["norm_mod"] += rows * d * el * 2  # the first adaLN: read + write
        w["residual"] += rows * d * el * 3  # the last gated residual: read 2, write 1
        w["res_norm"] += (
            rows * d * el * 4 * (1 + branches)
        )  # each residual add + the norm after it: 2 in, 2 out
        w["gelu"] += t * f / n * el * 2
    by = rank_bytes(cfg, tp, sp, fp8, kv_fp8, el)
    p = _passes(cfg)
    once = w.pop("linear_once", 0.0)
    out = {k: (v * p, "byte") for k, v in w.items()}
    for k in ("linear", "attention", "cross_attention", "audio_attention"):
        out[k] = (w[k] * p, "flop")
    out["linear"] = (w["linear"] * p + once, "flop")
    out["quant"] = (by["quant"], "byte")
    out["bias"] = out["linear_glue"] = out["attn_glue"] = (0.0, "byte")  # a fused epilogue moves nothing more
    return out


def part_work(cfg: CadenceConfig, tp: int, sp: bool, fp8: bool, kv_fp8: bool, el: int = 2) -> dict:
    """Per part of the step profile (``cadence.bench.step_profile``): the work one rank does in one chunk and
    its floor at the H200 ceilings: part -> {amount, unit ('flop' | 'byte'), floor_ms, at}. Parts whose floor
    is 0 are work a fused kernel would not do (bias adds into a GEMM epilogue, copies). Not counted (floor
    None): the audio front end, the collectives' stand-ins (their link floor is the ``comm`` part of
    :func:`floors_ms`), gaps, the unnamed rest."""
    m, p = cfg.model, _passes(cfg)
    _, a = _audio_tokens(cfg)
    t = cfg.tokens_per_chunk
    work = _per_layer_work(cfg, tp, sp, fp8, kv_fp8, el)
    patch = m.in_channels * math.prod(m.patch)
    # the timestep path: none (a pass's embedding is the same in every chunk: kept, cadence.runtime.chunk; run
    # per pass it reads the float32 time MLP + projection weights, (freq + 7 dim) dim x 4 B, each pass); per
    # pass: patch embedding and head (bf16 GEMMs, every rank); per chunk: the audio embedder; per pass the
    # sampler's latent updates (read x, v; write x)
    work["timestep"] = (0.0, "byte")
    work["embed_head"] = (2 * t * patch * m.dim * 2 * p, "flop")
    work["audio_embed"] = (2 * a * (m.audio_dim * m.dim + m.dim * m.dim) if m.audio_every else 0.0, "flop")
    lat = t * patch
    work["sampler"] = (lat * 4 * 3 * p, "byte")
    work["rope_table"] = (t * m.head_dim * 4 * 2, "byte")
    out = {}
    for k, (amount, unit) in work.items():
        if unit == "flop":
            rate = TFLOPS["fp8_gemm" if fp8 and k == "linear" else "bf16_gemm"] * 1e12
            if k.endswith("attention"):
                rate = TFLOPS["fp8_attn" if kv_fp8 and k == "attention" else "bf16_attn"] * 1e12
            at = f"{rate / 1e12:.0f} TFLOP/s"
        else:
            rate, at = HBM_BYTES_S, f"{HBM_BYTES_S / 1e12:.1f} TB/s"
        out[k] = {"amount": amount, "unit": unit, "floor_ms": amount / rate * 1e3, "at": at}
    return out
