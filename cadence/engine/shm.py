"""Frames through shared memory: a ring of one-chunk slots both processes map.

Pickled through the pipe, a large chunk's frames (W1.3: 12 x 480 x 832 x 3 = 14.4 MB every 500 ms) sit on the
critical path of every chunk, and the web side's reader thread competes with the event loop for the GIL while it
rebuilds the array; through shared memory the cost is the worker's write and the web side's copy out (the
measured figures: docs/perf/serve/NOTES.md). So frames of 1 MiB and more go through a :class:`FrameRing`: the
web side creates ``max_in_flight + 1`` slots of one chunk each in one ``multiprocessing.shared_memory``
segment, lends a free slot with every chunk request, the worker writes the frames there (on CUDA the
device-to-host copy lands in the slot directly) and answers with the slot; the web side copies the chunk out
and frees the slot. A request without a free slot falls back to the pipe. The segment is unlinked when the
group stops (and re-created on restart). Torch-free.
"""

from __future__ import annotations

import logging
import threading
from multiprocessing import shared_memory

import numpy as np

log = logging.getLogger("cadence.serve")

#: A chunk's frames at least this large go through shared memory under frame_transport='auto'.
SHM_MIN_BYTES = 1 << 20


class FrameRing:
    """``slots`` buffers of one chunk's frames (uint8 ``shape`` = [F, H, W, 3]) in one shared-memory
    segment. The web side creates it (``create``) and owns the free list; the worker attaches by name
    (``attach``) and writes the slot it is told to. ``unlink`` (owner) / ``close`` release it."""

    def __init__(self, shm: shared_memory.SharedMemory, shape: tuple[int, ...], slots: int, owner: bool):
        self.shm, self.shape, self.slots, self.owner = shm, tuple(int(x) for x in shape), int(slots), owner
        self.slot_bytes = int(np.prod(self.shape))
        self._free: list[int] = list(range(self.slots))
        self._lock = threading.Lock()
        self._closed = False

    @property
    def name(self) -> str:
        return self.shm.name

    @classmethod
    def create(cls, shape: tuple[int, ...], slots: int) -> FrameRing:
        if slots < 1:
            raise ValueError(f"a frame ring needs >= 1 slot, got {slots}")
        size = int(np.prod(shape)) * slots
        return cls(shared_memory.SharedMemory(create=True, size=size), shape, slots, owner=True)

    @classmethod
    def attach(cls, name: str, shape: tuple[int, ...], slots: int) -> FrameRing:
        try:  # Python >= 3.13: the creator's resource tracker alone owns the segment
            shm = shared_memory.SharedMemory(name=name, track=False)
        except TypeError:  # 3.11/3.12: the spawned child shares the parent's tracker (registering is a no-op)
            shm = shared_memory.SharedMemory(name=name)
        return cls(shm, shape, slots, owner=False)

    def view(self, slot: int) -> np.ndarray:
        if not 0 <= slot < self.slots:
            raise ValueError(f"frame slot {slot} out of range 0..{self.slots - 1}")
        return np.ndarray(self.shape, np.uint8, self.shm.buf, offset=slot * self.slot_bytes)

    def acquire(self) -> int | None:
        """A free slot for the next chunk request (None: all in use; the chunk then uses the pipe)."""
        with self._lock:
            return self._free.pop(0) if self._free and not self._closed else None

    def release(self, slot: int | None) -> None:
        if slot is None:
            return
        with self._lock:
            if 0 <= slot < self.slots and slot not in self._free:
                self._free.append(slot)

    def read(self, slot: int) -> np.ndarray:
        """A copy of the frames in ``slot`` (the slot can be reused at once)."""
        v = self.view(slot)
        out = v.copy()
        del v
        return out

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def close(self) -> None:
        """Detach (and, for the owner, unlink) the segment. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.shm.close()
        except (
            BufferError
        ):  # pragma: no cover - a view still exported (a bug): keep the mapping, still unlink
            log.warning("frame ring %s: a view is still in use at close", self.name)
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
