#!/usr/bin/env bash
# The fused FP8 producers on ONE H200 (issue 27 item 4; docs/perf/fp8/NOTES.md "GPU parity of the fused
# producers"): tests/test_fused_quant.py with its full failure text, then a diagnosis of the kernels' float32
# values before the model-dtype rounding against torch's on the same GPU (ulps, bf16 flips, e4m3 bytes), the
# tiny model's determinism and the unfused path's quantisation bytes. ~60-90 s.
# Usage (repo root, device machine):  bash scripts/device_fused_quant.sh    (DIAG=0: the tests and the check)
# Outputs: $OUT/fq.log (pytest), $OUT/check.log (torch's CUDA scalar division, the kernels' bytes against the
# references, the tiny model's errors), $OUT/diag.log (the diagnosis of the first call, kernel variants).
set -uo pipefail
source "$(dirname "$0")/device_lib.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
timeout -k 10 240 python3 -m pytest -q -p no:cacheprovider tests/test_fused_quant.py tests/test_fp8_quant.py \
  --tb=short -rA 2>&1 | grep -v DEBUG > "$OUT/fq.log"
grep -E "passed|failed|^FAILED|^E  " "$OUT/fq.log" | head -60
cat > /tmp/fq_check.py <<'PY'
# torch's CUDA division by a Python scalar, the kernels' bytes after the fix, the tiny model's errors
import sys, torch
sys.path.insert(0, "tests")
from cadence.kernels import quant as kq
import test_fused_quant as T
from cadence.runtime.compile import apply_fused_quant, remove_fused_quant
a = torch.rand(1 << 20, device="cuda") * 100 + 1e-3
inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32)
print("amax / 448 on CUDA: == amax * float32(1/448):", torch.equal(a / 448.0, a * inv.item()),
      "| == IEEE quotient (CPU):", torch.equal((a / 448.0).cpu(), a.cpu() / 448.0),
      f"| rows off the quotient: {((a / 448.0).cpu() != a.cpu() / 448.0).float().mean().item():.1%}")
for shape, dt in [((68, 256), torch.bfloat16), ((5, 1000), torch.bfloat16), ((512, 4096), torch.bfloat16), ((512, 4096), torch.float32)]:
    x = T._x(shape, dt, seed=shape[0]); x.view(-1)[:4] = torch.tensor([-60.0, -9.0, 0.0, 30.0], dtype=dt)
    q, s = kq.gelu_quantize_rows_triton(x); qr, sr = kq.gelu_quantize_rows_reference(x)
    print(f"gelu {shape} {dt}: scales equal {torch.equal(s, sr)}, bytes differ {(q.view(torch.uint8) != qr.view(torch.uint8)).float().mean().item():.4%}")
for shape in [(1, 64, 1536), (50, 256), (1, 748, 5120)]:
    for dt in (torch.bfloat16, torch.float32):
        g = torch.Generator().manual_seed(len(shape) + shape[-1])
        w = (torch.randn(shape[-1], generator=g) * 0.3 + 1).cuda(); b = (torch.randn(shape[-1], generator=g) * 0.2).cuda()
        x = T._x(shape, dt, seed=shape[-1])
        q, s = kq.quantize_rows_layer_norm_triton(x, w, b, 1e-6); qr, sr = kq.quantize_rows_layer_norm_reference(x, w, b, 1e-6)
        print(f"layer norm {shape} {dt}: scale rel {((s - sr).abs() / sr).max().item():.2e}, bytes differ {(q.view(torch.uint8) != qr.view(torch.uint8)).float().mean().item():.4%}")
with torch.no_grad():
    for dtype in (torch.float32, torch.bfloat16):
        model, inp = T._tiny(dtype)
        ref = model.forward_full(*inp)
        for impl in ("torch", "triton"):
            apply_fused_quant(model, impl=impl)
            out = model.forward_full(*inp)
            print(f"tiny {dtype} fused {impl}: rel err {((out.double() - ref.double()).norm() / ref.double().norm()).item():.3g}")
            remove_fused_quant(model)
PY
timeout -k 10 120 python3 /tmp/fq_check.py 2>&1 | grep -v DEBUG | tee "$OUT/check.log"
[[ "${DIAG:-1}" == 1 ]] || exit 0
mkdir -p /tmp/fqdiag && cat > /tmp/fqdiag/diag.py <<'PY'
import math, sys, torch, triton, triton.language as tl
import torch.nn.functional as F
sys.path.insert(0, ".")
from triton.language.extra.cuda import libdevice
from cadence.kernels import quant as kq
from cadence.kernels.quant_triton import _round_model, _norm_modulate
torch.backends.cuda.matmul.allow_tf32 = False
D = "cuda"

@triton.jit
def gelu_h(X, H, H1, M, K, BLOCK_K: tl.constexpr, V: tl.constexpr, ROUND: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    m = cols < K
    x = tl.load(X + row * K + cols, mask=m, other=0.0).to(tl.float32)
    if V == 0:  # as the kernel: x / (1 + exp(-2u)), approximate '/'
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        g = x / (1.0 + tl.exp(tl.minimum(-2.0 * u, 80.0)))
    elif V == 1:  # exact division
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        g = tl.math.div_rn(x, 1.0 + tl.exp(tl.minimum(-2.0 * u, 80.0)))
    elif V == 2:  # exact division, libdevice exp
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        g = tl.math.div_rn(x, 1.0 + libdevice.exp(tl.minimum(-2.0 * u, 80.0)))
    else:  # torch's formula and order, libdevice tanh
        xc = x * x * x
        inner = 0.7978845608028654 * (x + 0.044715 * xc)
        g = 0.5 * x * (1.0 + libdevice.tanh(inner))
    tl.store(H + row * K + cols, g, mask=m)
    tl.store(H1 + row * K + cols, _round_model(g, ROUND), mask=m)

@triton.jit
def ln_h(X, W, B, H, H1, M, K, eps, BLOCK_K: tl.constexpr, V: tl.constexpr, ROUND: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    cm = cols < K
    mask = cm[None, :]
    x = tl.load(X + row * K + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    w = tl.load(W + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    b = tl.load(B + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    kf = K * 1.0
    if V == 0:  # as the kernel
        h = _norm_modulate(x, mask, b, w, kf, eps, False, 0)
    else:  # torch-like: rsqrt, w * d * rstd + b
        one = tl.full([1], 1.0, tl.float32)
        mean = tl.math.div_rn(tl.sum(x, axis=1), one * kf)
        d = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.math.div_rn(tl.sum(d * d, axis=1), one * kf)
        rstd = tl.math.rsqrt(var + eps)
        h = tl.where(mask, w * d * rstd[:, None] + b, 0.0)
    tl.store(H + row * K + cols[None, :], h, mask=mask)
    tl.store(H1 + row * K + cols[None, :], _round_model(h, ROUND), mask=mask)

def ulps(a, b):
    ia = a.float().view(torch.int32).long(); ib = b.float().view(torch.int32).long()
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia); ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return (ia - ib).abs()

def qstats(q, s, qr, sr):
    rel = ((s - sr).abs() / sr).max().item()
    rows = int(((s != sr).sum()).item())
    frac = (q.view(torch.uint8) != qr.view(torch.uint8)).float().mean().item()
    return f"scale rel {rel:.2e} ({rows} rows differ) bytes {frac:.3%}"

def _x(shape, dtype, seed, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * spread + 0.3).to(dtype).to(D)

print("== GELU: kernel variants' float32 vs torch F.gelu(x.float()) on CUDA")
for shape in [(68, 256), (5, 1000), (2, 7, 96), (512, 4096)]:
    for dt in (torch.bfloat16, torch.float16):
        x = _x(shape, dt, seed=shape[0])
        x.view(-1)[:4] = torch.tensor([-60.0, -9.0, 0.0, 30.0], dtype=dt)
        x2 = x.reshape(-1, x.shape[-1]).contiguous(); M, K = x2.shape
        ref32 = F.gelu(x2.float(), approximate="tanh"); refd = F.gelu(x2, approximate="tanh")
        same = torch.equal(ref32.to(dt), refd)
        qr, sr = kq.gelu_quantize_rows_reference(x)
        qk, sk = kq.gelu_quantize_rows_triton(x)
        print(f"{shape} {dt}: ref32.to(dt)==F.gelu(x_dt) {same}; kernel vs ref: {qstats(qk, sk, qr, sr)}")
        for V in range(4):
            H = torch.empty(M, K, device=D); H1 = torch.empty_like(H)
            try:
                gelu_h[(M,)](x2, H, H1, M, K, BLOCK_K=triton.next_power_of_2(K), V=V, ROUND=kq._round_code(dt))
            except Exception as e:
                print(f"   V{V}: {type(e).__name__}: {str(e)[:300]}"); continue
            u = ulps(H, ref32); flips = (H1.to(dt) != refd).float().mean().item()
            grid_ok = torch.equal(H1.to(dt).float(), H1) and torch.equal(H.to(dt), H1.to(dt))
            q, s = kq.quantize_rows_reference(H1.to(dt))
            print(f"   V{V}: ulps max {u.max().item()} mean {u.float().mean().item():.3f} >0 {(u>0).float().mean().item():.3%}; "
                  f"{dt} flips {flips:.4%}; grid round ok {grid_ok}; {qstats(q, s, qr, sr)}")

print("== LayerNorm affine: kernel variants' float32 vs F.layer_norm(x.float(), w, b) on CUDA")
for shape in [(1, 37, 128), (1, 64, 1536), (50, 256), (2, 3, 1000), (1, 748, 5120)]:
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    w = (torch.randn(shape[-1], generator=g) * 0.3 + 1).to(D)
    b = (torch.randn(shape[-1], generator=g) * 0.2).to(D)
    x = _x(shape, torch.bfloat16, seed=shape[-1])
    x2 = x.reshape(-1, x.shape[-1]).contiguous(); M, K = x2.shape
    ref32 = F.layer_norm(x2.float(), (K,), w, b, 1e-6); refd = ref32.to(torch.bfloat16)
    qr, sr = kq.quantize_rows_layer_norm_reference(x, w, b, 1e-6)
    qk, sk = kq.quantize_rows_layer_norm_triton(x, w, b, 1e-6)
    print(f"{shape}: kernel vs ref: {qstats(qk, sk, qr, sr)}")
    # the modulated form (F.layer_norm no affine, * w + b in torch): what test_fp8_quant checks
    n32 = F.layer_norm(x2.float(), (K,), None, None, 1e-6)
    mod32 = n32 * w + b
    print(f"   torch affine LN vs torch (LN * w + b): ulps max {ulps(ref32, mod32).max().item()}, "
          f"bf16 flips {(mod32.to(torch.bfloat16) != refd).float().mean().item():.4%}")
    for V in range(2):
        H = torch.empty(M, K, device=D); H1 = torch.empty_like(H)
        ln_h[(M,)](x2, w, b, H, H1, M, K, 1e-6, BLOCK_K=triton.next_power_of_2(K), V=V, ROUND=1)
        u = ulps(H, ref32); um = ulps(H, mod32)
        flips = (H1.to(torch.bfloat16) != refd).float().mean().item()
        q, s = kq.quantize_rows_reference(H1.to(torch.bfloat16))
        print(f"   V{V}: ulps vs affine max {u.max().item()} mean {u.float().mean().item():.3f}; vs LN*w+b max {um.max().item()} "
              f"mean {um.float().mean().item():.3f}; bf16 flips {flips:.4%}; {qstats(q, s, qr, sr)}")

print("== tiny model on CUDA")
sys.path.insert(0, "tests")
import test_fused_quant as T
from cadence.quant import fp8
from cadence.runtime.compile import apply_fused_quant, remove_fused_quant
for dtype in (torch.float32, torch.bfloat16):
    model, inp = T._tiny(dtype)
    with torch.no_grad():
        a = model.forward_full(*inp); b2 = model.forward_full(*inp)
        print(f"{dtype}: forward_full deterministic {torch.equal(a, b2)}")
        seen = []
        real = fp8.quantize_activations
        def spy(x):
            q, s = real(x); qr, sr = kq.quantize_rows_reference(x)
            seen.append((tuple(x.shape), (q.view(torch.uint8) != qr.view(torch.uint8)).sum().item(), torch.equal(s, sr)))
            return q, s
        fp8.quantize_activations = spy
        model.forward_full(*inp)
        fp8.quantize_activations = real
        bad = [t for t in seen if t[1] or not t[2]]
        print(f"   unfused quantize_activations vs reference: {len(seen)} calls, {len(bad)} differ {bad[:6]}")
        fp8.set_quant_backend("torch"); c = model.forward_full(*inp); fp8.set_quant_backend("auto")
        print(f"   unfused with torch quant == auto: {torch.equal(c, a)}")
        for impl in ("torch", "triton"):
            rep = apply_fused_quant(model, impl=impl)
            o1 = model.forward_full(*inp); o2 = model.forward_full(*inp)
            err = ((o1.double() - a.double()).norm() / a.double().norm()).item()
            print(f"   fused {impl}: err {err:.3g}, deterministic {torch.equal(o1, o2)}, {rep.status()}")
            remove_fused_quant(model)
        # which producer moves the output: fuse one at a time (torch impl)
        from cadence.runtime import compile as rc
        for name in ("norm_modulate", "layer_norm_cast", "gelu"):
            rep = apply_fused_quant(model, impl="torch")
            for other, p in rep.producers.items():
                if other != name:
                    p.failed = "off for the diagnosis"
            o = model.forward_full(*inp)
            err = ((o.double() - a.double()).norm() / a.double().norm()).item()
            print(f"   torch impl, only {name}: err {err:.3g}")
            remove_fused_quant(model)
print("done")
PY
timeout -k 10 200 python3 /tmp/fqdiag/diag.py 2>&1 | grep -v DEBUG > "$OUT/diag.log"
cat "$OUT/diag.log" | tail -n 120
