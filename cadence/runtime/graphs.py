"""CUDA-graph capture of the steady-state chunk step, with eager fallback for every other shape.

    runner = GraphRunner(max_graphs=4)
    x = runner.run(key, step, inputs, keep=cache)   # replays a graph once the step shape is steady

The runner is given a key and a function, never a session: ``key`` (:class:`~cadence.runtime.step.StepKey`)
is the step's shape signature, ``step(inputs)`` computes the passes from its inputs alone, ``keep`` is
what the captured graph reads besides them (the cache). ``Session.step`` is the caller.

What is captured: the denoising passes of one chunk (``Session.denoise`` = ``denoise_chunk``: every
``forward_chunk``, the sampler updates, the K/V commit into the ring). What stays outside:
``Session.prepare_step`` (``cache.begin_chunk``: host bookkeeping, the RoPE tables of the chunk and
the ring's write slot advanced on the device; the noise draws; the audio front end's FFT). The
per-chunk inputs (noise, renoise, audio feature tokens) and the prompt's cross-attention K/V are
copied into static buffers owned by the graph before each replay (text only when the inputs'
``TextContext`` object changed), and the graph's output is cloned after it.

Which steps are captured, and the key: a step is capturable only when every address and shape it
touches is fixed from chunk to chunk: a :class:`~cadence.cache.ring.RingCache` (its buffers are
preallocated and addressed by device tensors) whose window is full (while it fills, the visible
prefix grows), on CUDA, with no span recorder active. With FP8 K/V on the Triton path the ring reads
its visible length on the device (``RingCache.length_on_device``), so a filling step launches the same
kernels with the same arguments as a steady one: its key is the steady key, and the graph captured
once serves the whole stream from its first chunk (the bf16/cuDNN path slices a prefix with a host
int: there each fill stage is its own shape, eager unless ``capture_filling``).
The key (:class:`StepKey`) is the step's shape signature: device, dtype, latent shape, tokens per chunk, text (conditioning) length, audio
token shape, cache storage (bf16/fp8) and window, fill state, commit policy, passes and sampler,
and the identity of the session's cache (a graph reads that cache's buffers; each kept graph holds a
reference to its cache, so that identity cannot be recycled by a new cache while the graph lives).
Across sessions: a graph captured for session A's cache bakes in the addresses of A's ring
buffers, RoPE tables and write-slot tensors (all updated in place by ``begin_chunk``), of the model's
weights and of the generator's timesteps; nothing else of the session. It is therefore replayed only
for steps on that same cache object: a session reset in place (``Session.reset``, what
the engine does between streams) keeps its cache, so its key and its graphs stay valid; a new
session has a new cache, hence new keys, and captures its own. Anything else (the
first chunks while a bf16 ring fills, the naive cache, a new conditioning length's first step, the
CPU, graphs disabled) runs eagerly; each reason is logged once per key (``cadence.runtime.graphs``).

Bounded: at most ``max_graphs`` graphs are kept, least recently used evicted and freed
(``CUDAGraph.reset``), so a stream whose conditioning length changes every few chunks holds a bounded
amount of graph memory; a shape is captured only after ``warmup`` eager runs, and at most
``max_captures_per_key`` times (evictions cause recaptures; past that the shape runs eagerly, with
one log line), so captures are bounded too.

Testable without CUDA: the capture function is injectable (``capture=``); it takes a zero-argument
function computing the step from the static buffers and returns a handle with ``replay()`` and
``output`` (the static output tensor, valid after a replay) and optionally ``reset()``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cadence.model.dit import TextContext
from cadence.runtime.step import StepInputs, StepKey

log = logging.getLogger(__name__)

# Reasons that do not depend on the step shape are logged once per process (every new session would
# otherwise repeat them); shape reasons once per runner and key.
_GLOBAL_REASONS = ("disabled", "not_cuda", "not_ring_cache", "span_recorder_active")
_logged_global: set[tuple[str, str]] = set()


def reset_log_once() -> None:
    """Forget which process-wide fallback lines were logged (tests)."""
    _logged_global.clear()


def filling_shares_steady_graph(session) -> bool:
    """Whether `session`'s ring-filling steps have the steady step's key (a ring that reads its visible
    length on the device): then ``capture_filling`` has nothing to capture. False for no session."""
    return bool(getattr(getattr(session, "cache", None), "length_on_device", False))


class _CudaGraph:
    """The real capture: warm-up already happened (the shape's eager runs); capture on a side stream
    with the graph's own memory pool, then replay on the caller's current stream."""

    def __init__(self, fn: Callable[[], torch.Tensor], stream: torch.cuda.Stream):
        self.graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        # thread_local: the pipeline's decode thread keeps working on its own stream during a capture
        # (the default "global" mode would forbid its allocations and event syncs)
        with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            self.output = fn()
        torch.cuda.current_stream().wait_stream(stream)

    def replay(self) -> None:
        self.graph.replay()

    def reset(self) -> None:
        self.graph.reset()
        self.output = None


def cuda_capture(fn: Callable[[], torch.Tensor], stream: torch.cuda.Stream | None = None) -> _CudaGraph:
    """Capture `fn` (no host syncs, static addresses) as a CUDA graph."""
    return _CudaGraph(fn, stream if stream is not None else torch.cuda.Stream())


@dataclass
class _Entry:
    handle: object
    static: StepInputs  # the graph's input buffers, filled before every replay
    text_src: object  # the TextContext the static text was copied from (copied again when it changes)
    keep: object  # what the graph reads besides its inputs (the cache: kept alive, its id() is in the key)


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager: int = 0
    evictions: int = 0
    capture_failures: int = 0
    eager_reasons: dict[str, int] = field(default_factory=dict)


class GraphRunner:
    """Runs chunk steps: graph replay for captured steady-state shapes, eager otherwise. Graphs read
    the cache they were captured on (``keep``) and their own static input buffers.

    enabled: False runs everything eagerly (one log line). capture: the capture function (default:
    real CUDA capture, used only on CUDA devices; an injected one is used on any device, which is
    how the key/LRU/fallback logic is tested on the CPU).
    """

    MAX_LOGGED = 256  # distinct (reason, key) log lines before going quiet

    def __init__(
        self,
        enabled: bool = True,
        max_graphs: int = 4,
        warmup: int = 1,
        max_captures_per_key: int = 8,
        capture: Callable[[Callable[[], torch.Tensor]], object] | None = None,
        capture_filling: bool = False,
    ):
        if max_graphs < 1 or warmup < 1 or max_captures_per_key < 1:
            raise ValueError(
                f"need max_graphs >= 1 ({max_graphs}), warmup >= 1 ({warmup}), "
                f"max_captures_per_key >= 1 ({max_captures_per_key})"
            )
        self.enabled, self.max_graphs, self.warmup = enabled, max_graphs, warmup
        self.max_captures_per_key = max_captures_per_key
        self.capture_filling = capture_filling  # also capture the ring-filling steps (a graph per fill stage)
        self._capture = capture
        self._graphs: OrderedDict[StepKey, _Entry] = OrderedDict()
        self._seen: OrderedDict[StepKey, int] = OrderedDict()  # eager runs per key (bounded LRU)
        self._captured: dict[StepKey, int] = {}
        self._failed: set[StepKey] = set()
        self._logged: set[tuple[str, StepKey | None]] = set()
        self._stream: torch.cuda.Stream | None = None
        self.stats = GraphStats()
        self.last: str = ""  # what the last denoise did: "replay", "capture" or "eager:<reason>"

    # ---- introspection --------------------------------------------------------------------------
    @property
    def capture_fn(self) -> Callable[[Callable[[], torch.Tensor]], object] | None:
        """The injected capture function (None: real CUDA capture), for a session that captures its own pass
        (``cadence.runtime.call_graph.GraphedCall``: a clip family's)."""
        return self._capture

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> list[StepKey]:
        return list(self._graphs)

    # ---- the decision ---------------------------------------------------------------------------
    def eager_reason(self, key: StepKey) -> str | None:
        """Why this step cannot replay a graph (None: it can, now or after warm-up)."""
        from cadence.telemetry import spans

        if not self.enabled:
            return "disabled"
        if self._capture is None and not key.device.startswith("cuda"):
            return "not_cuda"
        if not key.cache.startswith("ring"):
            return "not_ring_cache"
        if not key.filled and not self.capture_filling:
            return "ring_filling"
        if spans._active is not None:
            return "span_recorder_active"
        if key in self._failed:
            return "capture_failed"
        if key not in self._graphs and self._captured.get(key, 0) >= self.max_captures_per_key:
            return "recapture_limit"
        return None

    _MESSAGES = {
        "disabled": "CUDA graphs disabled: every step runs eagerly",
        "not_cuda": "CUDA graphs need a CUDA device (step on {dev}): running eagerly",
        "not_ring_cache": "CUDA graphs need the ring cache (got {cache}: host-side state per chunk): running eagerly",
        "ring_filling": "ring cache still filling (window {window}): eager until the window is full",
        "span_recorder_active": "a span recorder is active (timing events cannot be captured): running eagerly",
        "capture_failed": "graph capture failed for this shape earlier: running it eagerly",
        "recapture_limit": "shape captured {n} times already (evicted and recaptured): eager from now on",
        "warmup": "new step shape: eager warm-up run before capture",
    }

    def _note(self, reason: str, key: StepKey) -> None:
        self.stats.eager += 1
        self.stats.eager_reasons[reason] = self.stats.eager_reasons.get(reason, 0) + 1
        self.last = f"eager:{reason}"
        if reason in _GLOBAL_REASONS:
            gk = (reason, key.cache if reason == "not_ring_cache" else key.device)
            if gk in _logged_global:
                return
            _logged_global.add(gk)
        else:
            # the fill stages of one stream are one story: log the filling once per shape, not per stage
            lk = (reason, dataclasses.replace(key, fill=0) if reason == "ring_filling" else key)
            if lk in self._logged or len(self._logged) >= self.MAX_LOGGED:
                return
            self._logged.add(lk)
        msg = self._MESSAGES[reason].format(
            dev=key.device, cache=key.cache, window=key.window_chunks, n=self._captured.get(key, 0)
        )
        log.info("cuda graphs: %s [%s]", msg, key.short())

    # ---- running --------------------------------------------------------------------------------
    def run(
        self, key: StepKey, step: Callable[[StepInputs], torch.Tensor], inp: StepInputs, keep: object = None
    ) -> torch.Tensor:
        """``step(inp)``: replayed from a graph captured for ``key``, or run eagerly, same result.

        ``step`` computes the denoising passes from its inputs alone (everything else it reads, the
        model, the cache buffers, the timesteps, must sit at fixed addresses); ``keep`` is the object
        whose buffers it reads (the cache), kept alive with the graph."""
        reason = self.eager_reason(key)
        if reason is not None:
            self._note(reason, key)
            return step(inp)
        entry = self._graphs.get(key)
        if entry is None:
            runs = self._seen.get(key, 0)
            if runs < self.warmup:
                self._seen[key] = runs + 1
                self._seen.move_to_end(key)
                while len(self._seen) > 4 * self.max_graphs + 16:
                    self._seen.popitem(last=False)
                self._note("warmup", key)
                return self._eager_on_capture_stream(step, inp, key)
            entry = self._capture_entry(step, inp, key, keep)
            if entry is None:
                return step(inp)
            self.last = "capture"
        else:
            self._graphs.move_to_end(key)
            self.last = "replay"
        self._fill(entry, inp)
        entry.handle.replay()
        self.stats.replays += 1
        return entry.handle.output.clone()

    def _eager_on_capture_stream(self, step, inp: StepInputs, key: StepKey) -> torch.Tensor:
        """Warm-up runs happen on the stream the capture will use (lazy library state such as cuBLAS
        workspaces is per stream), ordered with the caller's stream."""
        if self._capture is not None or not key.device.startswith("cuda"):
            return step(inp)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=inp.noise.device)
        cur = torch.cuda.current_stream(inp.noise.device)
        self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream):
            x = step(inp)
        cur.wait_stream(self._stream)
        x.record_stream(cur)
        return x

    def _capture_entry(self, step, inp: StepInputs, key: StepKey, keep: object) -> _Entry | None:
        static = StepInputs(
            noise=inp.noise.clone(),
            renoise=inp.renoise.clone() if inp.renoise is not None else None,
            audio=inp.audio.clone() if inp.audio is not None else None,
            text=TextContext([(k.clone(), v.clone()) for k, v in inp.text.kv]),
        )

        def fn() -> torch.Tensor:
            return step(static)

        try:
            if self._capture is not None:
                handle = self._capture(fn)
            else:
                if self._stream is None:
                    self._stream = torch.cuda.Stream(device=inp.noise.device)
                handle = cuda_capture(fn, self._stream)
        except Exception as e:
            self._failed.add(key)
            self.stats.capture_failures += 1
            log.warning(
                "cuda graphs: capture failed (%s: %s); this shape runs eagerly [%s]",
                type(e).__name__,
                e,
                key.short(),
            )
            self._note("capture_failed", key)
            return None
        self._captured[key] = self._captured.get(key, 0) + 1
        self.stats.captures += 1
        log.info(
            "cuda graphs: captured step [%s] (%d kept, max %d)",
            key.short(),
            len(self._graphs) + 1,
            self.max_graphs,
        )
        entry = _Entry(handle, static, inp.text, keep)
        self._graphs[key] = entry
        while len(self._graphs) > self.max_graphs:
            old_key, old = self._graphs.popitem(last=False)
            self._free(old)
            self.stats.evictions += 1
            log.info("cuda graphs: evicted least recently used graph [%s]", old_key.short())
        return entry

    @staticmethod
    def _fill(entry: _Entry, inp: StepInputs) -> None:
        st = entry.static
        st.noise.copy_(inp.noise)
        if st.renoise is not None:
            st.renoise.copy_(inp.renoise)
        if st.audio is not None:
            st.audio.copy_(inp.audio)
        if entry.text_src is not inp.text:  # the prompt changed (same length: same key)
            for (dk, dv), (sk, sv) in zip(st.text.kv, inp.text.kv):
                dk.copy_(sk)
                dv.copy_(sv)
            entry.text_src = inp.text

    @staticmethod
    def _free(entry: _Entry) -> None:
        reset = getattr(entry.handle, "reset", None)
        if reset is not None:
            reset()
        entry.handle = None

    def clear(self) -> None:
        """Free every graph (end of session)."""
        while self._graphs:
            self._free(self._graphs.popitem()[1])

    def graphs_for(self, cache) -> int:
        """How many kept graphs read `cache`'s buffers."""
        return sum(1 for e in self._graphs.values() if e.keep is cache)
