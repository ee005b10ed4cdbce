"""Names of devices as results and tables use them (``nvidia-h200``, ``nvidia-h200-x2``, ``cpu``).

The measured tables the engine reads at run time (the fused comm chooser's, ``cadence.parallel.fused``) and
the benchmark records (``cadence.bench.common``) are keyed by the same name, so it lives below both.
"""

from __future__ import annotations

import torch


def device_kind(device: torch.device, world: int = 1) -> str:
    """Short kind for file names: nvidia-h200, nvidia-h200-x2, cpu."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower().replace("nvidia ", "").replace(" ", "-")
    kind = f"nvidia-{name}"
    return f"{kind}-x{world}" if world > 1 else kind
