"""Count the elementwise kernels of one transformer block pass, with the residual add + norm pairs compiled as
one function each (``CADENCE_COMPILE_PAIRS=1``, the default) and as their halves (0: the kernels before).

    PYTHONPATH=. python3 scripts/count_elementwise_kernels.py            # CPU: Inductor's C++ kernels
    PYTHONPATH=. python3 scripts/count_elementwise_kernels.py --device cuda   # Triton kernels

Per block type (with / without audio attention) it runs one pass of a block through the ``ops`` seam with
every op compiled (``cadence.runtime.compile.FusedOps``), records which ops the block called and, for each
compiled op, how many kernels Inductor generated for it (its output code), plus the plain ``x + y`` adds of the
split pairs (one ATen kernel each). Prints one table; the q/k RMS norms (separate ops inside the attention
modules) are not counted here.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

import torch


def _kernels_of(fn, args) -> int:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(fn, dynamic=False, fullgraph=True), *args)
    code = "\n".join(codes)
    return len(re.findall(r"^(?:cpp_fused|triton_)\w* = async_compile", code, flags=re.M))


class _Recorder:
    """Wraps a block's ops: records each call (name, args) and forwards it."""

    def __init__(self, base):
        self.base, self.calls = base, []

    def __getattr__(self, name):
        fn = getattr(self.base, name)

        def call(*a):
            self.calls.append((name, a))
            return fn(*a)

        return call


def count(device: str, pairs: bool) -> dict:
    from cadence.config import get_preset
    from cadence.model import layers as L
    from cadence.model.weights import build_model
    from cadence.runtime.compile import PAIRS

    cfg = get_preset("tiny").with_overrides(model={"num_layers": 2, "audio_every": 2})
    dev = torch.device(device)
    model = build_model(cfg, dev, torch.bfloat16, seed=0)
    g = torch.Generator(device=dev).manual_seed(0)
    m = cfg.model
    gh, gw = cfg.token_grid
    x = torch.randn(1, gh * gw, m.dim, generator=g, device=dev).bfloat16()
    temb6 = torch.randn(1, 6, m.dim, generator=g, device=dev)
    text = model.prepare_text(torch.randn(1, m.text_len, m.text_dim, generator=g, device=dev))
    audio = model.prepare_audio(
        torch.randn(1, 1, m.audio_tokens_per_frame, m.audio_dim, generator=g, device=dev)
    )
    from cadence.model.full import FullSequence

    out = {}
    for i, blk in enumerate(model.blocks):
        rec = _Recorder(L.PLAIN_OPS)
        blk.ops = rec
        c, s = model.rope.grid_cos_sin(0, 1, gh, gw)
        with torch.no_grad():
            blk(x, temb6, FullSequence(c, s), i, False, text.kv[i], audio.kv[i], 1)
        kinds = "audio" if blk.audio_attn is not None else "no audio"
        calls = Counter(name for name, _ in rec.calls)
        kernels = 0
        per_op = {}
        for name, args in {n: a for n, a in rec.calls}.items():
            if name in PAIRS and not pairs:
                add, norm = PAIRS[name]
                k_add = 1 if add is None else _kernels_of(getattr(L, add), args[:3])
                k_norm = _kernels_of(getattr(L, norm), _norm_args(name, args))
                per_op[name] = f"{k_add} + {k_norm}"
                kernels += calls[name] * (k_add + k_norm)
            else:
                k = _kernels_of(getattr(L, name), args)
                per_op[name] = str(k)
                kernels += calls[name] * k
        out[kinds] = {"calls": dict(calls), "kernels_per_op": per_op, "kernels": kernels}
    return out


def _norm_args(name: str, args: tuple) -> tuple:
    """The norm half's arguments of a pair call (its input is the add's result: the same shape as x)."""
    x = args[0]
    rest = args[3:] if name == "gate_residual_layer_norm" else args[2:]
    return (x, *rest)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    rows = []
    for pairs in (False, True):
        for kind, r in count(a.device, pairs).items():
            rows.append((pairs, kind, r))
    print(f"{'pairs':6} {'block':9} {'kernels':>7}  ops called (kernels per op)")
    for pairs, kind, r in rows:
        ops = ", ".join(f"{n} x{c} ({r['kernels_per_op'][n]})" for n, c in r["calls"].items())
        print(f"{'one' if pairs else 'split':6} {kind:9} {r['kernels']:>7}  {ops}")


if __name__ == "__main__":
    main()
