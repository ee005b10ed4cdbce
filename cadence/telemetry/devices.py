"""Names of devices as results and tables use them (``nvidia-h200``, ``nvidia-h200-x2``, ``cpu``).

The measured tables the engine reads at run time (the fused comm chooser's, ``cadence.parallel.fused``) and
the benchmark records (``cadence.bench.common``) are keyed by the same name, so it lives below both.
"""

from __future__ import annotations

import os

import torch


def device_kind(device: torch.device, world: int = 1) -> str:
    """Short kind for file names: nvidia-h200, nvidia-h200-x2, cpu."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower().replace("nvidia ", "").replace(" ", "-")
    kind = f"nvidia-{name}"
    return f"{kind}-x{world}" if world > 1 else kind


def cpu_info() -> dict:
    """The CPU this ran on: model, logical cores, and the vector extensions that decide CPU speed here."""
    info: dict = {"cores": os.cpu_count()}
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return info
    for line in text.splitlines():
        if line.startswith("model name") and "model" not in info:
            info["model"] = line.split(":", 1)[1].strip()
        if line.startswith("flags") and "flags" not in info:
            flags = set(line.split(":", 1)[1].split())
            info["flags"] = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    try:
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001  (informational only)
        pass
    return info
