"""Attention at the serving shapes: torch SDPA backends (bf16) vs Cadence's ring kernel (FP8 / bf16).

One query chunk (tokens_per_chunk queries) over the full window (kv_tokens keys), heads/tp heads,
head_dim 128 at the real presets. Every variant sees the same random q/k/v; errors are relative L2
against a float32 reference computed from the unquantised inputs. Used by `cadence bench cache`.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from cadence.bench.common import Timer, median
from cadence.kernels import ring_attention as ra


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def sdpa_backends():
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover
        return {}
    return {
        "cudnn": (sdpa_kernel, SDPBackend.CUDNN_ATTENTION),
        "flash": (sdpa_kernel, SDPBackend.FLASH_ATTENTION),
        "efficient": (sdpa_kernel, SDPBackend.EFFICIENT_ATTENTION),
    }


def kernel_configs(device: torch.device, mode: str) -> list[dict]:
    """Block shapes to try (chosen from a first sweep on an H200; docs/perf/cache/NOTES.md)."""
    if device.type != "cuda":
        return [dict(block_m=32, block_n=32, num_warps=None, num_stages=None)]
    shapes = (
        [
            (64, 128, 4, 3),
            (64, 128, 4, 2),
            (128, 128, 8, 3),
            (128, 64, 4, 3),
            (64, 256, 4, 2),
            (128, 256, 8, 2),
        ]
        if mode == "fp8"
        else [(128, 128, 8, 3), (128, 64, 8, 2), (64, 128, 4, 3)]
    )
    return [dict(block_m=a, block_n=b, num_warps=w, num_stages=st) for a, b, w, st in shapes]


@torch.no_grad()
def attention_bench(
    heads: int,
    m: int,
    n: int,
    d: int,
    device: torch.device,
    iters: int = 30,
    splits=(1, 2),
    seed: int = 0,
    log=print,
) -> dict:
    """Time each variant; returns {variant: {ms, tflops, rel_err}} plus best picks."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(m, heads, d, generator=g, device=device)
    k = torch.randn(n, heads, d, generator=g, device=device)
    v = torch.randn(n, heads, d, generator=g, device=device)
    flops = 4.0 * m * n * d * heads
    timer = Timer(device)
    res: dict[str, dict] = {}

    # float32 reference from unquantised inputs (chunked over heads to bound memory)
    ref = torch.empty(m, heads, d, device=device)
    for h0 in range(0, heads, 8):
        sl = slice(h0, h0 + 8)
        ref[:, sl] = (
            F.scaled_dot_product_attention(
                q[:, sl].transpose(0, 1)[None].double(),
                k[:, sl].transpose(0, 1)[None].double(),
                v[:, sl].transpose(0, 1)[None].double(),
            )[0]
            .transpose(0, 1)
            .float()
        )

    qb, kb, vb = (x.transpose(0, 1)[None].to(torch.bfloat16).contiguous() for x in (q, k, v))
    for name, (ctx, backend) in sdpa_backends().items():
        if device.type != "cuda":
            break
        try:
            with ctx(backend):
                out = F.scaled_dot_product_attention(qb, kb, vb)
                ts = timer.run(lambda: F.scaled_dot_product_attention(qb, kb, vb), 3, iters)
        except RuntimeError as e:
            log(f"  sdpa {name}: not available ({str(e).splitlines()[0][:80]})")
            continue
        res[f"sdpa_{name}_bf16"] = {
            "ms": median(ts),
            "tflops": flops / median(ts) / 1e9,
            "rel_err": _rel(out[0].transpose(0, 1), ref),
        }
    # the call the model makes today (naive cache): [1, N, H, D] views, default backend
    qv, kv_, vv = (x[None].to(torch.bfloat16) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qv.transpose(1, 2), kv_.transpose(1, 2), vv.transpose(1, 2))
    ts = timer.run(
        lambda: F.scaled_dot_product_attention(qv.transpose(1, 2), kv_.transpose(1, 2), vv.transpose(1, 2)),
        3,
        iters,
    )
    res["sdpa_model_call_bf16"] = {
        "ms": median(ts),
        "tflops": flops / median(ts) / 1e9,
        "rel_err": _rel(out[0].transpose(0, 1), ref),
    }

    ok, why = ra.triton_usable(device, d, allow_interpreter=True)
    if not ok:
        log(f"  ring kernel: skipped ({why})")
        return res
    n_valid = torch.tensor([n], dtype=torch.int32).to(device)
    n_alloc = (n + 127) // 128 * 128  # the ring pads its buffers: TMA rows of vt must be 16-byte aligned
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    for mode, dt in (("fp8", ra.FP8), ("bf16", torch.bfloat16)):
        Q = torch.empty(heads, m, d, device=device, dtype=dt)
        QS = torch.ones(heads, m, device=device)
        K = torch.zeros(heads, n_alloc, d, device=device, dtype=dt)
        KS = torch.ones(heads, n_alloc, device=device)
        VT = torch.zeros(heads, d, n_alloc, device=device, dtype=dt)
        VS = torch.ones(heads, n_alloc, device=device)
        ra.rope_quant_write(q, None, None, Q, QS, zero)
        ra.rope_quant_write(k, None, None, K, KS, zero)
        ra.rope_quant_write(v, None, None, VT, VS, zero, transpose_out=True)
        best = None
        for cfg in kernel_configs(device, mode):
            for split in splits:
                key = f"ring_{mode}_m{cfg['block_m']}_n{cfg['block_n']}_w{cfg['num_warps']}_s{cfg['num_stages']}_x{split}"
                try:
                    call = functools.partial(
                        ra.ring_attention, Q, QS, K, KS, VT, VS, n_valid, split=split, **cfg
                    )
                    out = call()
                    ts = timer.run(call, 2, iters)
                except Exception as e:  # a config the compiler rejects (e.g. shared memory) is skipped
                    log(f"  {key}: failed ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
                    continue
                r = {
                    "ms": median(ts),
                    "tflops": flops / median(ts) / 1e9,
                    "rel_err": _rel(out, ref),
                    **cfg,
                    "split": split,
                }
                res[key] = r
                if best is None or r["ms"] < best[1]["ms"]:
                    best = (key, r)
                print(
                    f"\r  {key}: {r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s err {r['rel_err']:.4f}   ",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
        print(file=sys.stderr)
        if best:
            res[f"best_ring_{mode}"] = {"variant": best[0], **best[1]}
    return res


def summarise(res: dict, flops_note: str = "") -> list[tuple[str, str]]:
    rows = []
    for key in (
        "sdpa_cudnn_bf16",
        "sdpa_flash_bf16",
        "sdpa_efficient_bf16",
        "sdpa_model_call_bf16",
        "best_ring_fp8",
        "best_ring_bf16",
    ):
        if key in res:
            r = res[key]
            extra = f"  [{r['variant']}]" if "variant" in r else ""
            rows.append(
                (key, f"{r['ms']:8.3f} ms {r['tflops']:6.0f} TFLOP/s  rel_err {r['rel_err']:.4f}{extra}")
            )
    if "sdpa_cudnn_bf16" in res and "best_ring_fp8" in res:
        rows.append(
            ("fp8 ring / cuDNN bf16", f"{res['sdpa_cudnn_bf16']['ms'] / res['best_ring_fp8']['ms']:.2f}x")
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    from cadence.bench.common import print_table
    from cadence.config import get_preset

    p = argparse.ArgumentParser(prog="cadence bench attention")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = get_preset(a.preset)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads = cfg.model.num_heads // a.tp
    res = attention_bench(heads, cfg.tokens_per_chunk, cfg.kv_tokens, cfg.model.head_dim, dev, a.iters)
    print_table(
        summarise(res),
        f"attention {a.preset} tp{a.tp}: {heads} heads, {cfg.tokens_per_chunk} q x "
        f"{cfg.kv_tokens} kv, d {cfg.model.head_dim}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
