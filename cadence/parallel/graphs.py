"""CUDA-graph capture of a tensor-parallel step: every rank of the group captures, or none does.

NCCL treats "this collective was graph-captured" as a collective property: every rank of the
communicator must launch the graph derived from the same collective capture (NCCL user guide,
"Using NCCL with CUDA Graphs"). The symmetric-memory all-reduces of :mod:`cadence.parallel.fused`
go further: a call reads the peers' copy of the same symmetric buffer, so a rank replaying a graph
(fixed buffers, fixed ping-pong order) next to a rank running eagerly (the buffer cache's current
ping-pong index) would read the wrong buffer. So a capture that fails on one rank must fail on all.

``agreeing_capture(group)`` wraps a capture function (``cadence.runtime.graphs.cuda_capture`` by
default, or an injected one: tests) for :class:`cadence.runtime.graphs.GraphRunner`: after the
local capture attempt, the ranks all-reduce (MIN) a success flag, outside any capture; if any rank
failed, every rank drops its graph and raises, so the runner falls back to eager on every rank with
its one warning line. A world of one (or no process group) skips the agreement.

Capture itself is capture-safe for the row-parallel layers as long as the warm-up ran first (the
symmetric buffers are allocated and rendezvoused on first use, eagerly; the chooser's per-shape
decisions and every fallback decision are host state made during warm-up, identical on every rank
because every rank sees the same shapes and the same table).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class CaptureDisagreement(RuntimeError):
    """Graph capture failed on some rank of the group (this rank's graph, if any, was dropped)."""


def _flag_device(group) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_ranks_ok(ok: bool, group=None) -> bool:
    """True when `ok` is True on every rank of `group` (one tiny MIN all-reduce; True without a group)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return ok
    t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_flag_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(int(t.item()))


def agreeing_capture(
    group=None, capture: Callable | None = None, stream: torch.cuda.Stream | None = None
) -> Callable[[Callable[[], torch.Tensor]], object]:
    """A capture function for ``GraphRunner(capture=...)`` that succeeds on every rank or on none.

    `capture(fn)` does the local capture (default: ``cuda_capture(fn, stream)`` with one side stream
    kept for all captures, made lazily); its handle needs ``replay()``, ``output`` and optionally
    ``reset()``."""
    state: dict = {"stream": stream}

    def local(fn):
        if capture is not None:
            return capture(fn)
        from cadence.runtime.graphs import cuda_capture

        if state["stream"] is None:
            state["stream"] = torch.cuda.Stream()
        return cuda_capture(fn, state["stream"])

    def run(fn):
        handle, err = None, None
        try:
            handle = local(fn)
        except Exception as e:  # noqa: BLE001  (any capture failure: agree first, then raise)
            err = e
        if all_ranks_ok(err is None, group):
            return handle
        if handle is not None:
            reset = getattr(handle, "reset", None)
            if reset is not None:
                reset()
        if err is not None:
            raise CaptureDisagreement(
                f"graph capture failed on this rank ({type(err).__name__}: "
                + (str(err).splitlines()[0] if str(err) else "")
                + ")"
            ) from err
        raise CaptureDisagreement(
            "graph capture failed on another rank of the group; dropping this rank's graph"
        )

    return run
