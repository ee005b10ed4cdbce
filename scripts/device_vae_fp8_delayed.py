"""Issue 17, session 10 (FP8 convs, delayed activation scaling) on one H200, in one process:
(A) GPU parity: the Triton quantisation vs the torch one (bytes, scale, amax; per call and delayed with
clamping) at a decoder shape; the image error of a random-weight Wan 2.2 decoder stream at 176x272 (1 + 3
chunks, eager) against the plain decoder in fp32: bf16 + FP8 up blocks with per-call scaling, delayed
(headroom 2, the default) and delayed with headroom 1; host syncs during a stream's later chunks.
(B) timing at 704x1088 (bf16, cudnn.benchmark, `accelerate_decoder(vae, 'fp8')`): per scaling (delayed,
call; a VAE each), a warm stream of 1 + 3 chunks, then a fresh stream: its first (1-frame) chunk and 8
further chunks; then one profiled first chunk and one profiled further chunk (top kernels) of the last.
Prints one line per row and a table last; JSON to argv[1]. CADENCE_FP8_PARTS=A,B picks parts."""

import copy
import json
import math
import os
import sys
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from cadence.bench.common import Timer, median
from cadence.kernels import conv_fp8 as cf
from cadence.model.vae import WanVAE, wan_vae_config
from cadence.runtime import vae_fast

out: dict = {
    "device": torch.cuda.get_device_name(),
    "torch": torch.__version__,
    "git": os.environ.get("CADENCE_GIT"),
}
parts = os.environ.get("CADENCE_FP8_PARTS", "A,B").split(",")
torch.backends.cudnn.benchmark = True
timer = Timer(torch.device("cuda"))
table: list[str] = []


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def run(vae, z, sizes):
    st = vae.stream()
    outs, i = [], 0
    for k in sizes:
        outs.append(st.decode_chunk(z[:, i : i + k].to(vae.param_dtype())).float())
        i += k
    return torch.cat(outs, 1)


if "A" in parts:
    x = torch.randn(1, 256, 6, 88, 136, device="cuda").to(torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last_3d)
    par = {}
    for label, prev in (("call", None), ("delayed", x.float().abs().amax().reshape(1) / 4)):
        q1, s1, a1 = cf.quantize_input(x, prev)
        q2, s2, a2 = cf.quantize_input_triton(x, prev)
        par[label] = {
            "bytes_equal": bool(torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))),
            "scale_equal": bool(torch.equal(s1, s2)),
            "amax_equal": bool(torch.equal(a1, a2)),
            "clamped_frac": float((q2.float().abs() == cf.FP8_MAX).float().mean()),
            "nan": bool(q2.float().isnan().any()),
        }
        print(f"parity quant {label}: {par[label]}", flush=True)
    out["quant_parity"] = par
    h, w = 176, 272
    torch.manual_seed(0)
    ref32 = WanVAE(wan_vae_config("2.2")).cuda().eval()
    with torch.no_grad():
        for nm, p in ref32.named_parameters():
            if nm.endswith("gamma"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    sizes = [1, 1, 1, 1]
    z = torch.randn(ref32.z_dim, sum(sizes), h // 16, w // 16, device="cuda")
    want = run(ref32, z, sizes)
    stream = []
    res = {}
    for label, scaling, headroom in (
        ("bf16 plain", None, None),
        ("fp8 call", "call", None),
        ("fp8 delayed headroom 2", "delayed", 2.0),
        ("fp8 delayed headroom 1", "delayed", 1.0),
    ):
        m = copy.deepcopy(ref32).to(torch.bfloat16)
        vae_fast.channels_last(m.decoder)
        if scaling:
            vae_fast.fp8_convs(
                m.decoder.up_blocks, "triton", multiple=128, scaling=scaling, decoder=m.decoder
            )
        cf.DELAYED_HEADROOM = headroom or 2.0
        st = m.stream()
        outs = [st.decode_chunk(z[:, :1].to(torch.bfloat16)).float()]
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            for i in range(1, 4):
                outs.append(st.decode_chunk(z[:, i : i + 1].to(torch.bfloat16)).float())
            torch.cuda.set_sync_debug_mode("default")
        got = torch.cat(outs, 1)
        res[label] = got
        mse = float(((got - want) ** 2).mean())
        e = {"case": label, "rel_l2": rel(got, want), "psnr_db": 10 * math.log10(4.0 / max(mse, 1e-20))}
        e["syncs_in_later_chunks"] = sum("synchroniz" in str(c.message) for c in caught)
        if label.startswith("fp8 delayed"):
            e["rel_vs_fp8_call"] = rel(got, res["fp8 call"])
        stream.append(e)
        print(f"stream 2.2 {h}x{w}: {e}", flush=True)
        table.append(
            f"err {label:24s} rel L2 {e['rel_l2']:.4f} PSNR {e['psnr_db']:.1f} dB syncs {e['syncs_in_later_chunks']}"
        )
        del m
        torch.cuda.empty_cache()
    cf.DELAYED_HEADROOM = 2.0
    out["stream"] = stream
    del ref32
    torch.cuda.empty_cache()
    json.dump(out, open(sys.argv[1], "w"), indent=1)


def top(prof, n=14):
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / 1e3, ev.count, ev.key[:100]))
    rows.sort(reverse=True)
    return sum(r[0] for r in rows), rows[:n]


if "B" in parts:
    z = torch.randn(48, 1 + 3 + 1 + 8 + 2, 44, 68, device="cuda", dtype=torch.bfloat16)
    timing = {}
    for scaling in os.environ.get("SCALINGS", "delayed call").split():
        os.environ["CADENCE_CONV_FP8_SCALE"] = scaling
        torch.manual_seed(0)
        vae = WanVAE(wan_vae_config("2.2")).cuda().to(torch.bfloat16).eval()
        rep = vae_fast.accelerate_decoder(vae, "fp8")
        t0 = time.time()
        st = vae.stream()
        for i in range(4):
            st.decode_chunk(z[:, i : i + 1])
        torch.cuda.synchronize()
        warm_s = time.time() - t0
        st = vae.stream()
        first = timer.run(lambda st=st: st.decode_chunk(z[:, 4:5]), warmup=0, iters=1)[0]
        times = [
            timer.run(lambda i=i, st=st: st.decode_chunk(z[:, 5 + i : 6 + i]), warmup=0, iters=1)[0]
            for i in range(8)
        ]
        r = {
            "applied": rep.describe(),
            "warm_s": warm_s,
            "first_chunk_ms": first,
            "chunk_ms": times,
            "chunk_median_ms": median(times),
            "chunk_max_ms": max(times),
        }
        print(
            f"timing fp8 {scaling} [{r['applied']}]: warm-up {warm_s:.0f} s, first {first:.1f} ms, "
            f"median {r['chunk_median_ms']:.1f} max {r['chunk_max_ms']:.1f} ms",
            flush=True,
        )
        table.append(
            f"vae2.2 704x1088 fp8 {scaling:8s}: chunk median {r['chunk_median_ms']:.1f} ms max "
            f"{r['chunk_max_ms']:.1f}, first (1 frame) {first:.1f} ms"
        )
        timing[scaling] = r
        out["timing"] = timing
        json.dump(out, open(sys.argv[1], "w"), indent=1)
        if scaling == "delayed":
            for label, sl, fresh in (("first", slice(13, 14), True), ("further", slice(14, 15), False)):
                if fresh:
                    st = vae.stream()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    st.decode_chunk(z[:, sl])
                    torch.cuda.synchronize()
                tot, rows = top(prof)
                r[f"profile_{label}"] = {"kernels_ms": tot, "top": rows}
                print(f"profile fp8 {scaling} {label} chunk: kernels {tot:.1f} ms", flush=True)
                for t, n, k in rows:
                    print(f"  {t:8.2f} ms {n:4d}x  {k}")
        del vae, st
        torch.cuda.empty_cache()
    json.dump(out, open(sys.argv[1], "w"), indent=1)
print("=== table")
print("\n".join(table))
