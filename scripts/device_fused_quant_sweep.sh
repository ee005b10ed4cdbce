#!/usr/bin/env bash
# The fused FP8 producers' launch configurations on ONE H200 (docs/perf/fp8/NOTES.md "GPU parity of the fused
# producers": with the default configs of cadence/kernels/quant.py launch_config they lost to the compiled op +
# the separate quantisation), ~60 s: per producer at the W57 shapes (748 rows; norm + modulation and the affine
# LayerNorm at K = 8192, the GELU at 24576 (TP=1 fc1 out) and 6144 (TP=4)), BLOCK_M x num_warps (x programs per
# SM for the shared-modulation grid), each CUDA-graph replayed (20 calls a graph, median of 15 replays), its
# bytes against the reference's, and the separate quantisation alone for scale.
# Usage (repo root, device machine):  bash scripts/device_fused_quant_sweep.sh     Output: $OUT/sweep.log
set -uo pipefail
source "$(dirname "$0")/device_lib.sh"
cat > /tmp/fq_sweep.py <<'PY'
import itertools, torch, triton
from cadence.kernels import quant as kq
torch.manual_seed(0)
D = "cuda"
def us(fn, inner=20, reps=15):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay(); torch.cuda.synchronize()
    t = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); t.append(a.elapsed_time(b) * 1e3 / inner)
    return sorted(t)[len(t) // 2]
def same(qs, ref):
    return int((qs[0].view(torch.uint8) != ref[0].view(torch.uint8)).sum()), bool(torch.equal(qs[1], ref[1]))
M = 748
rows = []
for K in (8192,):
    x = (torch.randn(1, M, K, device=D) * 2 + 0.3).to(torch.bfloat16)
    a = torch.randn(1, 1, K, device=D) * 0.3; b = torch.randn(1, 1, K, device=D) * 0.3
    w, bias = (a + 1).reshape(K), b.reshape(K)
    gb = M * K * 2 + M * K + M * 4
    print(f"separate quantisation {M}x{K}: {us(lambda: kq.quantize_rows_triton(x.view(M, K))):.1f} us (default config)")
    refs = {"norm_modulate": kq.quantize_rows_modulated_reference(x, a, b, 1e-6, "layer", x.dtype),
            "layer_norm": kq.quantize_rows_layer_norm_reference(x, w, bias, 1e-6)}
    print(f"default launch_config (modulated): {kq.launch_config(K, False, modulated=True)}, programs per SM {kq.PROGRAMS_PER_SM}")
    for kind in ("norm_modulate", "layer_norm"):
        args = (x, a, b) if kind == "norm_modulate" else (x, bias, w)
        po = kind == "norm_modulate"
        for bm, nw, pps in itertools.product((1, 2), (4, 8, 16, 32), (1, 2, 4, 8, 0)):
            if bm * K // (nw * 32) > 64 or (nw == 4 and bm * K > 8192):
                continue  # > 64 float32 per thread per array: spills
            kw = dict(block_m=bm, num_warps=nw, programs_per_sm=pps or 64, plus_one=po)
            f = lambda: kq.quantize_rows_modulated_triton(*args, 1e-6, **kw)
            try:
                t = us(f); d = same(f(), refs[kind])
            except Exception as e:
                print(f"  {kind} bm {bm} nw {nw} pps {pps}: {type(e).__name__} {str(e)[:120]}"); continue
            rows.append((kind, K, bm, nw, pps, t))
            print(f"  {kind:13s} {M}x{K} bm {bm} nw {nw:2d} pps {pps or 'all':>3}: {t:6.1f} us  {gb / t / 1e6:5.2f} TB/s  bytes off {d[0]} scales equal {d[1]}")
for K in (24576, 6144):
    x = (torch.randn(M, K, device=D) * 2 + 0.3).to(torch.bfloat16)
    ref = kq.gelu_quantize_rows_reference(x)
    gb = M * K * 2 + M * K + M * 4
    print(f"separate quantisation {M}x{K}: {us(lambda: kq.quantize_rows_triton(x)):.1f} us; default gelu config {kq.launch_config(K, False, modulated=True)}")
    bk = triton.next_power_of_2(K)
    for bm, nw in itertools.product((1, 2, 4), (4, 8, 16, 32)):
        if bm * bk // (nw * 32) > 64 or bm * bk // (nw * 32) < 4:
            continue
        q = torch.empty(M, K, dtype=kq.FP8, device=D); s = torch.empty(M, 1, device=D)
        f = lambda: kq._kernels()[2][(triton.cdiv(M, bm),)](x, x.stride(0), q, q.stride(0), s, M, K, BLOCK_M=bm, BLOCK_K=bk,
                                                             ROUND=1, AMAX_MIN=kq.AMAX_MIN, FP8_MAX=kq.FP8_MAX, num_warps=nw)
        try:
            t = us(f); f(); d = same((q, s), ref)
        except Exception as e:
            print(f"  gelu bm {bm} nw {nw}: {type(e).__name__} {str(e)[:120]}"); continue
        rows.append(("gelu", K, bm, nw, 0, t))
        print(f"  gelu          {M}x{K} bm {bm} nw {nw:2d}: {t:6.1f} us  {gb / t / 1e6:5.2f} TB/s  bytes off {d[0]} scales equal {d[1]}")
print("best per producer:")
for kind, K in (("norm_modulate", 8192), ("layer_norm", 8192), ("gelu", 24576), ("gelu", 6144)):
    r = sorted((t, bm, nw, pps) for k2, K2, bm, nw, pps, t in rows if k2 == kind and K2 == K)
    if r:
        print(f"  {kind} {M}x{K}: {r[0][0]:.1f} us at bm {r[0][1]} nw {r[0][2]} pps {r[0][3] or 'all'}; 2nd {r[1][0] if len(r) > 1 else '-'}")
PY
timeout -k 10 ${SWEEP_LIMIT_S:-150} python3 /tmp/fq_sweep.py 2>&1 | grep -v DEBUG | tee "$OUT/sweep.log"
