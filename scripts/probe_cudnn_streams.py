"""Are a decoder's cuDNN timings kept from stream to stream? (one GPU, ~2 min per mode)

Where it belongs: a one-GPU probe (not part of the package), run by the plan `probes` of
scripts/device_plans.toml; what it found: docs/perf/pipeline/NOTES.md and docs/perf/vae/NOTES.md.

Seven streams of the Wan 2.1 decoder at 480x832 (random weights, bf16) in ONE thread: each stream's first
1-frame chunk, then four 12-frame chunks, timed with a device sync around each. ``bench`` sets
``cudnn.benchmark`` (the ``--decoder-fast bench`` path), ``compile`` leaves it off. A small allocation
between streams moves the caching allocator's addresses.

    PYTHONPATH=. python3 scripts/probe_cudnn_streams.py bench|compile
"""

import sys
import time

import torch

from cadence.model.vae import WanVAE, wan_vae_config
from cadence.runtime.vae_fast import accelerate_decoder


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "bench"
    dev = torch.device("cuda")
    model = WanVAE(wan_vae_config("2.1")).to(dev, torch.bfloat16).eval()
    rep = accelerate_decoder(model, mode)
    print(mode, rep.describe(), "cudnn.benchmark", torch.backends.cudnn.benchmark, flush=True)
    g = torch.Generator(device="cpu").manual_seed(0)
    lat = torch.randn(16, 1 + 3 * 4, 60, 104, generator=g).to(dev, torch.bfloat16)
    keep = []
    with torch.no_grad():
        for s in range(7):
            keep.append(torch.empty(int(torch.randint(1, 4000, (1,))) * 1024 + 16 * s, device=dev))
            st = model.stream()
            row = []
            for sl in [lat[:, :1]] + [lat[:, 1 + 3 * k : 4 + 3 * k] for k in range(4)]:
                torch.cuda.synchronize()
                t = time.perf_counter()
                st.decode_chunk(sl)
                torch.cuda.synchronize()
                row.append((time.perf_counter() - t) * 1e3)
            print(f"stream {s}: " + " ".join(f"{x:8.1f}" for x in row), flush=True)


if __name__ == "__main__":
    main()
