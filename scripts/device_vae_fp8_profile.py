"""Where a further 4-frame Wan 2.2 chunk at 704x1088 spends its GPU time with a decoder fast path
(argv[1], e.g. fp8 / compile): random weights, bf16, 3 warm-up chunks, 5 timed, then one chunk under
torch.profiler; prints the median chunk time and the top CUDA kernels (total ms, calls). JSON to argv[2]."""

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from cadence.bench.common import Timer, median
from cadence.model.vae import WanVAE, wan_vae_config
from cadence.runtime.vae_fast import accelerate_decoder

mode = sys.argv[1]
torch.backends.cudnn.benchmark = True
vae = WanVAE(wan_vae_config("2.2")).cuda().to(torch.bfloat16).eval()
rep = accelerate_decoder(vae, mode)
z = torch.randn(48, 10, 44, 68, device="cuda", dtype=torch.bfloat16)
st = vae.stream()
st.decode_chunk(z[:, :1])
for i in range(3):
    st.decode_chunk(z[:, 1 + i : 2 + i])
timer = Timer(torch.device("cuda"))
times = [timer.run(lambda i=i: st.decode_chunk(z[:, 4 + i : 5 + i]), warmup=0, iters=1)[0] for i in range(5)]
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    st.decode_chunk(z[:, 9:10])
    torch.cuda.synchronize()
rows = []
for ev in prof.key_averages():
    t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
    if t > 0:
        rows.append((t / 1e3, ev.count, ev.key[:110]))
rows.sort(reverse=True)
total = sum(r[0] for r in rows)
print(f"profile {mode} [{rep.describe()}]: chunk median {median(times):.1f} ms, kernels total {total:.1f} ms")
for t, n, k in rows[:28]:
    print(f"  {t:8.2f} ms {n:4d}x  {k}")
json.dump(
    {"mode": mode, "applied": rep.describe(), "chunk_ms": times, "kernels": rows[:60]},
    open(sys.argv[2], "w"),
    indent=1,
)
