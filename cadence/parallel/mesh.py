"""Process-group setup for tensor parallelism (one process per rank, launched by torchrun).

    info = init_tp()                    # reads RANK / WORLD_SIZE / LOCAL_RANK (torchrun's env)
    model = build_model(cfg, info.device, torch.bfloat16)
    apply_tp(model, info.group)
    ...
    destroy_tp()

NCCL on CUDA (the device is set from LOCAL_RANK before the group exists), gloo on CPU. NVLink
multicast / NVLS is switched off by default (``setdefault``: an explicit setting wins) before the
group is created: on shared hosts a program using NVLink multicast can take every GPU of the host
out of service, and the collectives here (small all-reduces) gain nothing from it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: Environment defaults applied before the process group is created.
ENV_DEFAULTS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass(frozen=True)
class TPInfo:
    """Where this process sits in the tensor-parallel group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    group: dist.ProcessGroup


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    try:
        return default if v is None else int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None


def init_tp(backend: str | None = None, timeout_s: float | None = None) -> TPInfo:
    """Join (or create) the default process group from torchrun's environment and return this
    rank's :class:`TPInfo`. Without torchrun's variables it is a group of one (rank 0 of 1; needs
    MASTER_ADDR / MASTER_PORT like any ``env://`` init). `backend` defaults to nccl when CUDA is
    available, else gloo. `timeout_s`: how long a collective may wait for the other ranks before it
    fails (torch's default otherwise: minutes; a server wants a dead peer noticed sooner)."""
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world:
        raise ValueError(f"RANK {rank} is outside WORLD_SIZE {world}")
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    backend = backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise ValueError(f"LOCAL_RANK {local_rank} but only {n} CUDA device(s) are visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kw = {"device_id": device} if backend == "nccl" else {}
        if timeout_s is not None:
            import datetime

            kw["timeout"] = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world, **kw)
    return TPInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=dist.get_backend(),
        group=dist.group.WORLD,
    )


def _default_store():
    """The default group's key-value store (the TCPStore rank 0 serves in a group started without
    torchrun), or None where this torch has no such accessor."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except (RuntimeError, ValueError):
        return None


def destroy_tp(barrier_timeout_s: float = 10.0, exiting: bool = False) -> None:
    """Tear the default process group down (safe to call when none exists).

    With gloo, every rank first waits (up to ``barrier_timeout_s``) until all ranks have reached their
    teardown: a rank that closed its connections while a peer was still finishing made that peer's
    gloo thread abort the process ("terminate called without an active exception", seen in 1 of 4-6
    runs of a two-rank test). A peer that is gone only costs the timeout; the teardown proceeds.

    Then rank 0 keeps the group's store up until every other rank has destroyed its group (each sets a
    key in it when done; rank 0 waits up to ``barrier_timeout_s``). Where rank 0 serves the store (a
    serve worker group: rank 0 is the master), its exit used to close the store under a follower whose
    NCCL heartbeat thread was still polling it: a screenful of "Broken pipe" C++ traces from the
    follower at every stop of a W14 TP=2 server on 2x H200. Under torchrun the agent serves the store
    and the wait costs one round trip.

    ``exiting=True`` (a process that leaves with ``os._exit`` right after, as the serve worker ranks do)
    skips ``destroy_process_group`` on NCCL: there it blocked both ranks of a serve worker group for more
    than 10 s at every stop (CUDA graphs hold the communicators; 2x H200, torch 2.11, NCCL 2.28), until
    the server killed them, rank 0 first, so the follower's heartbeat thread printed "Broken pipe"
    traces against the vanished store. The store handshake still orders the exits; the driver frees the
    communicators with the process."""
    if not dist.is_initialized():
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    if dist.get_backend() == "gloo" and world > 1:
        import datetime

        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=barrier_timeout_s))
        except RuntimeError:  # a rank that never came: nothing left to protect
            pass
    store = _default_store() if world > 1 else None
    t0 = time.monotonic()
    skip = exiting and dist.get_backend() == "nccl"
    if not skip:
        dist.destroy_process_group()
    t1 = time.monotonic()
    how = "no store" if store is None else ""
    if store is not None:
        import datetime

        try:
            if rank:
                store.set(f"cadence/destroyed/{rank}", "1")
                how = "told rank 0"
            else:
                store.wait(
                    [f"cadence/destroyed/{r}" for r in range(1, world)],
                    datetime.timedelta(seconds=barrier_timeout_s),
                )
                how = "every rank done"
        except (RuntimeError, ValueError) as e:  # rank 0 gone, or a rank that never came: nothing to protect
            how = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
    if world > 1:
        log.info(
            "tp teardown, rank %d of %d: group %s in %.0f ms, store %s after %.0f ms",
            rank,
            world,
            "left to the exit" if skip else "destroyed",
            (t1 - t0) * 1e3,
            how,
            (time.monotonic() - t1) * 1e3,
        )
