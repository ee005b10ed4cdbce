"""A random TAEHV decoder in the published ``taew2_1.pth`` layout, made with Self-Forcing's own TAEHV class, so
the Cadence side of the TAEHV side-by-side decodes with the same class as the reference (not part of Cadence).

    python scripts/reference_taehv_weights.py --ref .ref/Self-Forcing --out /tmp/taew2_1_random.pth

Self-Forcing's demo decodes with ``demo_utils.taehv.TAEHV`` loaded from madebyollin's ``taew2_1.pth``
(decoder stages 256/128/64/64 wide, 3 MemBlocks a stage, ~10M parameters). Without ``--taehv-weights``
Cadence's ``--decoder taehv`` builds its own smaller random TAEHV (one MemBlock a stage): a different amount
of work. This script draws that class's random weights (``torch.manual_seed``, PyTorch's default init) and
saves its state dict as the published file is saved; ``cadence bench pipeline --decoder taehv
--taehv-weights FILE`` then loads it into ``PublishedTAEHV`` (geometry read off the tensors). ~40 MB in
float32: made on the device machine, never committed or carried."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, type=Path, help="checkout of guandeh17/Self-Forcing")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("sf_taehv", a.ref / "demo_utils/taehv.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(a.seed)
    sd = mod.TAEHV(checkpoint_path=None).state_dict()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(sd, str(a.out))
    n = sum(v.numel() for k, v in sd.items() if k.startswith("decoder."))
    print(f"wrote {a.out}: {len(sd)} tensors, decoder {n / 1e6:.2f}M parameters")


if __name__ == "__main__":
    main()
