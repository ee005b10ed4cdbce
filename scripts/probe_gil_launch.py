"""Does a decode thread's blocked kernel launch hold up the diffusion thread? (one GPU, ~20 s)

Where it belongs: a one-GPU probe (not part of the package), run by the plan `probes` of
scripts/device_plans.toml; what it found: docs/perf/pipeline/NOTES.md.

The engine's decode thread enqueues a chunk's decode (hundreds of kernels) behind a stream wait on the
step that makes its latent. Once the device's launch queue is full, a launch blocks in the driver, and
PyTorch keeps the GIL through a launch. The diffusion thread wakes when that step ends, to launch the
next one, and waits for the GIL: up to Python's switch interval (``sys.getswitchinterval``, 5 ms).

This probe mimics the two threads with plain kernels: the "diffusion" thread waits for its previous
step on the host (``steps_in_flight=1``), then launches 20 small kernels (the step's eager preparation)
and a ~15 ms chain of matmuls (the step); the "decode" thread enqueues --decode-kernels small kernels
behind a wait on each step. It reports the diffusion thread's host time from its wake-up to the end of
its launches, and the GPU time of its step, without the decode thread and with it at two intervals.

    PYTHONPATH=. python3 scripts/probe_gil_launch.py [--decode-kernels 3000] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time

import torch


def run(mode: str, interval_ms: float, steps: int, decode_kernels: int) -> dict:
    dev = torch.device("cuda:0")
    sys.setswitchinterval(interval_ms / 1e3)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    small = torch.zeros(1 << 16, device=dev)
    dec_buf = torch.zeros(1 << 16, device=dev)
    dec_stream = torch.cuda.Stream(dev)
    jobs: queue.Queue = queue.Queue()
    host_ms, gpu_ms = [], []

    def decoder() -> None:
        while True:
            ready = jobs.get()
            if ready is None:
                return
            dec_stream.wait_event(ready)
            with torch.cuda.stream(dec_stream):
                for _ in range(decode_kernels):
                    dec_buf.mul_(1.0000001)
                done = torch.cuda.Event()
                done.record(dec_stream)
            done.synchronize()

    th = threading.Thread(target=decoder, daemon=True) if mode == "decode-thread" else None
    if th is not None:
        th.start()
    prev = None
    for i in range(steps):
        if prev is not None:
            prev.synchronize()
        t0 = time.perf_counter()
        e0, e1, ready = torch.cuda.Event(True), torch.cuda.Event(True), torch.cuda.Event()
        e0.record()
        for _ in range(20):  # the step's eager preparation
            small.add_(1.0)
        b = a
        for _ in range(10):  # the step (a CUDA graph replay in the engine)
            b = a @ b
        e1.record()
        ready.record()
        t1 = time.perf_counter()
        if th is not None:
            jobs.put(ready)
        if prev is not None and i >= 5:
            host_ms.append((t1 - t0) * 1e3)
        prev = ready
        if i >= 5:
            gpu_ms.append((e0, e1))
    torch.cuda.synchronize()
    if th is not None:
        jobs.put(None)
        th.join()
    g = [x.elapsed_time(y) for x, y in gpu_ms]
    return {
        "mode": mode,
        "switch_interval_ms": interval_ms,
        "host_launch_ms_p50": round(statistics.median(host_ms), 3),
        "host_launch_ms_max": round(max(host_ms), 3),
        "step_gpu_ms_p50": round(statistics.median(g), 3),
        "step_gpu_ms_mean": round(statistics.mean(g), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode-kernels", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = [
        run("alone", 5.0, args.steps, args.decode_kernels),
        run("decode-thread", 5.0, args.steps, args.decode_kernels),
        run("decode-thread", 0.5, args.steps, args.decode_kernels),
        run("alone", 5.0, args.steps, args.decode_kernels),
    ]
    print(f"{'mode':<15}{'interval':>10}{'host p50':>10}{'host max':>10}{'gpu p50':>10}{'gpu mean':>10}")
    for r in rows:
        print(
            f"{r['mode']:<15}{r['switch_interval_ms']:>10}{r['host_launch_ms_p50']:>10}"
            f"{r['host_launch_ms_max']:>10}{r['step_gpu_ms_p50']:>10}{r['step_gpu_ms_mean']:>10}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f)


if __name__ == "__main__":
    main()
