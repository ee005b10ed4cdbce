"""One function of tensors replayed from a CUDA graph: :class:`GraphedCall` (a clip family's model pass).

    call = GraphedCall(lambda x, t, ref: model(x, t, ref), sticky=(2,), stats=runner.stats)
    v = call(x, t, ref)      # eager for the first ``warmup`` calls of a signature, then captured, then replayed

A clip family's clips have fixed shapes (FlashHead: 33 frames at one size), so its model pass can be captured
once and replayed for every pass of every clip: no Python or launch overhead per kernel. What it takes: a
function of tensors only (``fn(*tensors) -> tensor``; everything else it reads, the model's weights, at fixed
addresses), called with the same signature (shapes, dtypes, device) every time. Each call copies its inputs into
the graph's static buffers (``sticky`` positions only when the caller passes another tensor object than last
time: the reference latent and the audio K/V, the same objects for the four passes of a clip) and returns a
clone of the graph's output (the next replay overwrites it).

Not captured (eager instead, with one log line per reason): graphs disabled, a CPU call without an injected
``capture`` (tests inject ``tests/fake_graph.py``), a span recorder active (timing events cannot be captured), a
capture that raised (that signature stays eager). Warm-up calls run on the capture stream (cuBLAS and Triton
state is per stream), as ``cadence.runtime.graphs.GraphRunner`` does for the K/V families; the counts go into
a ``GraphStats`` (the engine's runner's, so the warm-up and stream reports show them).

Exact: a replay launches the kernels the eager call launched, on the same inputs (tests: ``FakeGraph`` on the
CPU; on CUDA the same kernels, so the same bits).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from cadence.runtime.graphs import GraphStats, cuda_capture

log = logging.getLogger(__name__)


class GraphedCall:
    """``fn(*tensors)`` replayed from one CUDA graph per input signature (module docstring)."""

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        *,
        enabled: bool = True,
        warmup: int = 1,
        capture: Callable[[Callable[[], torch.Tensor]], object] | None = None,
        sticky: Sequence[int] = (),
        stats: GraphStats | None = None,
        name: str = "call",
    ):
        self.fn, self.enabled, self.warmup, self.name = fn, enabled, max(1, warmup), name
        self._capture = capture
        self.sticky = frozenset(sticky)
        self.stats = stats if stats is not None else GraphStats()
        self._graphs: dict[tuple, tuple[object, list[torch.Tensor], list]] = {}
        self._seen: dict[tuple, int] = {}
        self._failed: set[tuple] = set()
        self._logged: set[str] = set()
        self._stream: torch.cuda.Stream | None = None
        self.last = ""

    def _why_eager(self, args: Sequence[torch.Tensor], key: tuple) -> str | None:
        from cadence.telemetry import spans

        if not self.enabled:
            return "disabled"
        if self._capture is None and args[0].device.type != "cuda":
            return "not_cuda"
        if spans._active is not None:
            return "span_recorder_active"
        if key in self._failed:
            return "capture_failed"
        return None

    def _eager(self, why: str, args) -> torch.Tensor:
        if why not in self._logged:
            self._logged.add(why)
            log.info("%s: eager (%s)", self.name, why)
        self.last = f"eager:{why}"
        if why not in ("warmup", "capture_failed"):
            return self.fn(*args)
        self.stats.eager += 1
        return self._on_capture_stream(args)

    def _on_capture_stream(self, args) -> torch.Tensor:
        if self._capture is not None or args[0].device.type != "cuda":
            return self.fn(*args)
        dev = args[0].device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=dev)
        cur = torch.cuda.current_stream(dev)
        self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream):
            out = self.fn(*args)
        cur.wait_stream(self._stream)
        out.record_stream(cur)
        return out

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        key = tuple((tuple(a.shape), a.dtype, str(a.device)) for a in args)
        why = self._why_eager(args, key)
        if why is not None:
            return self._eager(why, args)
        entry = self._graphs.get(key)
        if entry is None:
            runs = self._seen.get(key, 0)
            if runs < self.warmup:
                self._seen[key] = runs + 1
                return self._eager("warmup", args)
            entry = self._capture_entry(key, args)
            if entry is None:
                return self._eager("capture_failed", args)
            self.last = "capture"
        else:
            self.last = "replay"
        handle, static, src = entry
        for i, (s, a) in enumerate(zip(static, args)):
            if i not in self.sticky or src[i] is not a:
                s.copy_(a)
                src[i] = a
        handle.replay()
        self.stats.replays += 1
        return handle.output.clone()

    def _capture_entry(self, key: tuple, args) -> tuple | None:
        static = [a.clone() for a in args]

        def run() -> torch.Tensor:
            with torch.no_grad():
                return self.fn(*static)

        try:
            if self._capture is not None:
                handle = self._capture(run)
            else:
                if self._stream is None:
                    self._stream = torch.cuda.Stream(device=args[0].device)
                handle = cuda_capture(run, self._stream)
        except Exception as e:  # this signature runs eagerly from now on
            self._failed.add(key)
            self.stats.capture_failures += 1
            log.warning("%s: CUDA graph capture failed (%s: %s); eager", self.name, type(e).__name__, e)
            return None
        self.stats.captures += 1
        log.info("%s: captured a CUDA graph (%d inputs)", self.name, len(args))
        entry = (handle, static, list(args))
        self._graphs[key] = entry
        return entry

    def clear(self) -> None:
        """Free every graph."""
        for handle, _, _ in self._graphs.values():
            reset = getattr(handle, "reset", None)
            if reset is not None:
                reset()
        self._graphs.clear()
