"""Issue 17, FP8 convs on one H200: (1) per conv shape of the Wan 2.2 decoder at 704x1088, parity and time of
the Triton FP8 kernel (and cuDNN's FP8 conv fprop when the ``cudnn`` frontend imports) against cuDNN's bf16
conv3d, channels last; (2) the image error of a decoder stream (random weights, 176x272, 1 + 3 chunks)
in bf16 and with the FP8 convs, against the plain decoder in fp32 (relative L2, PSNR over [-1, 1]).
Prints one line per row; JSON to argv[1]. Set CADENCE_FP8_PARTS=layers,stream to run a part only."""

import copy
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from cadence.bench.common import Timer, median
from cadence.kernels import conv_fp8 as cf
from cadence.model.vae import WanVAE, wan_vae_config
from cadence.runtime import vae_fast

out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
parts = os.environ.get("CADENCE_FP8_PARTS", "layers,stream").split(",")
timer = Timer(torch.device("cuda"))
torch.backends.cudnn.benchmark = os.environ.get("CUDNN_BENCH", "1") == "1"
cudnn_why = cf.why_not(torch.device("cuda"), "cudnn")
print("cudnn frontend:", cudnn_why or "importable", flush=True)
if not cudnn_why:
    import cudnn

    out["cudnn_backend_version"] = cudnn.backend_version()


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def t_ms(fn, iters=10):
    return median(timer.run(fn, warmup=2, iters=iters))


# (1) conv shapes: (name, C, N, T_out, H, W, kt) of the Wan 2.2 decoder's further 4-frame chunk at 704x1088
SHAPES = [
    ("up1.res 1024x1024 2x88x136", 1024, 1024, 2, 88, 136, 3),
    ("up2.res 512x512 4x176x272", 512, 512, 4, 176, 272, 3),
    ("up3.res 256x256 4x352x544", 256, 256, 4, 352, 544, 3),
    ("up2.upsample 512x512 4x352x544 (2D)", 512, 512, 4, 352, 544, 1),
]


def bench_layer(name, c, n, t, h, w, kt):
    torch.manual_seed(0)
    x = torch.randn(1, c, t + kt - 1, h, w, device="cuda", dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last_3d)
    wt = (torch.randn(n, c, kt, 3, 3, device="cuda") / math.sqrt(c * kt * 9)).to(torch.bfloat16)
    wt = wt.contiguous(memory_format=torch.channels_last_3d)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1
    flop = 2 * t * h * w * n * c * kt * 9
    r = {"name": name, "C": c, "N": n, "T": t, "H": h, "W": w, "kt": kt, "tflop": flop / 1e12}
    ref = F.conv3d(x, wt, bias, padding=(0, 1, 1))
    r["bf16_ms"] = t_ms(lambda: F.conv3d(x, wt, bias, padding=(0, 1, 1)))
    wq, sw = cf.quantize_weight(wt)
    q, sx, _ = cf.quantize_input(x)
    r["quant_eager_ms"] = t_ms(lambda: cf.quantize_input(x))
    qc = torch.compile(cf.quantize_input, dynamic=False)
    try:
        qc(x)
        r["quant_compiled_ms"] = t_ms(lambda: qc(x))
    except Exception as e:
        r["quant_compiled_err"] = f"{type(e).__name__}: {str(e)[:200]}"
    want = cf.conv3x3_fp8_reference(q, sx, wq, sw, bias.float(), kt, torch.float32)
    true32 = F.conv3d(x.float(), wt.float(), bias.float(), padding=(0, 1, 1)).permute(0, 2, 3, 4, 1)
    r["rel_fp8_ref_vs_fp32"] = rel(want, true32)
    r["rel_bf16_vs_fp32"] = rel(ref.permute(0, 2, 3, 4, 1), true32)
    bf = bias.float()
    for be in ("triton", "cudnn"):
        if be == "cudnn" and cudnn_why:
            continue
        fn = cf.conv3x3_fp8_triton if be == "triton" else cf.conv3x3_fp8_cudnn
        try:
            t0 = time.time()
            got = fn(q, sx, wq, sw, bf, kt, torch.bfloat16)
            torch.cuda.synchronize()
            r[f"{be}_first_s"] = time.time() - t0
            r[f"{be}_rel_vs_ref"] = rel(got, want)
            r[f"{be}_ms"] = t_ms(lambda fn=fn: fn(q, sx, wq, sw, bf, kt, torch.bfloat16))
            r[f"{be}_tflops"] = flop / r[f"{be}_ms"] / 1e9
        except Exception as e:
            r[f"{be}_err"] = f"{type(e).__name__}: {str(e)[:300]}"
    best = getattr(cf._kernel(False), "best_config", None)
    r["triton_best"] = str(best) if best is not None else None
    r["bf16_tflops"] = flop / r["bf16_ms"] / 1e9
    print(
        f"layer {name}: bf16 {r['bf16_ms']:.2f} ms ({r['bf16_tflops']:.0f} TF/s) | triton "
        + (
            f"{r['triton_ms']:.2f} ms ({r['triton_tflops']:.0f} TF/s) rel {r['triton_rel_vs_ref']:.1e}"
            if "triton_ms" in r
            else r.get("triton_err", "-")
        )
        + " | cudnn "
        + (
            f"{r['cudnn_ms']:.2f} ms ({r['cudnn_tflops']:.0f} TF/s) rel {r['cudnn_rel_vs_ref']:.1e}"
            if "cudnn_ms" in r
            else r.get("cudnn_err", cudnn_why[:60])
        )
        + f" | quant eager {r['quant_eager_ms']:.2f} compiled {r.get('quant_compiled_ms', float('nan')):.2f}"
        + f" | fp8 err {r['rel_fp8_ref_vs_fp32']:.3f} bf16 err {r['rel_bf16_vs_fp32']:.4f} [{r.get('triton_best')}]",
        flush=True,
    )
    torch.cuda.empty_cache()
    return r


rows = [bench_layer(*s) for s in SHAPES] if "layers" in parts else []
out["layers"] = rows


# (2) the image error of a decoder stream
def run(vae, z, sizes):
    st = vae.stream()
    outs, i = [], 0
    for k in sizes:
        outs.append(st.decode_chunk(z[:, i : i + k].to(vae.param_dtype())).float())
        i += k
    return torch.cat(outs, 1)


def err(got, want):
    mse = float(((got - want) ** 2).mean())
    return {"rel_l2": rel(got, want), "psnr_db": 10 * math.log10(4.0 / max(mse, 1e-20))}


stream = []
if "stream" in parts:
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
    cases = [("bf16 plain", torch.bfloat16, None, None)]
    backends = ["triton"] + ([] if cudnn_why else ["cudnn"])
    cases += [(f"bf16 + fp8 up_blocks ({be})", torch.bfloat16, be, "up_blocks") for be in backends]
    cases += [("bf16 + fp8 up_blocks + mid (triton)", torch.bfloat16, "triton", "all")]
    cases += [("fp32 + fp8 up_blocks (reference)", torch.float32, "reference", "up_blocks")]
    for label, dt, be, where in cases:
        m = copy.deepcopy(ref32).to(dt)
        vae_fast.channels_last(m.decoder)
        nconv = 0
        if be is not None:
            tgt = m.decoder.up_blocks if where == "up_blocks" else m.decoder
            nconv = vae_fast.fp8_convs(tgt, be, multiple=128)
        try:
            got = run(m, z, sizes)
            e = err(got, want)
            e.update(case=label, fp8_convs=nconv, frames=int(got.shape[1]))
        except Exception as ex:
            e = {"case": label, "error": f"{type(ex).__name__}: {str(ex)[:300]}"}
        stream.append(e)
        print(f"stream 2.2 {h}x{w}: {label}: {e}", flush=True)
        del m
        torch.cuda.empty_cache()
out["stream"] = stream
json.dump(out, open(sys.argv[1], "w"), indent=1)
