"""Several sessions per GPU (``cadence serve --sessions-per-gpu N``): the groups' placement, the memory check,
the capacity measured under load, a further group that runs out of memory at start left out, and the admission that keeps to it (503 with a true Retry-After, on a fake
clock), the MPS daemon (a stand-in binary), and, in the slow tier, two worker groups on one device (the CPU,
the tiny preset) streaming two sessions at once, each from its own state."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import math
import os
import stat
from types import SimpleNamespace

import numpy as np
import pytest

from cadence.engine.messages import (
    ChunkDone,
    ChunkRequest,
    ChunkTimings,
    Closed,
    CloseSession,
    Opened,
    OpenSession,
)
from cadence.engine.placement import Placement, Sharing, gpu_groups
from cadence.errors import ConfigError, InputError, one_line, out_of_memory
from cadence.serve.config import ServeConfig, placements_from_args, serve_groups
from cadence.serve.sharing import MEMORY_MARGIN, ShareRules, capacity_of, memory_error, memory_fit

# ---- placement ---------------------------------------------------------------------------------------------


def test_groups_share_a_gpu_interleaved_so_the_first_sessions_land_on_distinct_gpus():
    g = serve_groups("cuda", tp=1, gpus=2, sessions_per_gpu=3)
    assert [str(p) for p in g] == ["cuda:0", "cuda:1"] * 3
    assert [str(p) for p in serve_groups("cuda", tp=1, max_sessions=3, gpus=2, sessions_per_gpu=3)] == [
        "cuda:0",
        "cuda:1",
        "cuda:0",
    ]
    # one per GPU, as before; --decode-gpu left out; tensor-parallel sets shared alike
    assert serve_groups("cuda", gpus=4) == gpu_groups(1, 4, [0, 1, 2, 3])
    assert [str(p) for p in serve_groups("cuda", gpus=3, decode_gpu=0, sessions_per_gpu=2)] == [
        "cuda:1",
        "cuda:2",
    ] * 2
    assert [str(p) for p in serve_groups("cuda", tp=2, gpus=4, sessions_per_gpu=2)] == [
        "cuda:0+cuda:1",
        "cuda:2+cuda:3",
    ] * 2
    s = Sharing(serve_groups("cuda", tp=1, gpus=2, sessions_per_gpu=3))
    assert s.peers(0) == (0, 2, 4) and s.share(1) == 3 and s.describe() == "cuda:0 x3, cuda:1 x3"
    assert list(s.shared) == [Placement(("cuda:0",)), Placement(("cuda:1",))]
    assert Sharing(serve_groups("cuda", gpus=2)).shared == {}  # one per GPU: nothing shared
    # the CPU is one device: N groups on it, as --max-sessions N
    assert serve_groups("cpu", sessions_per_gpu=2) == (Placement(("cpu",)),) * 2
    assert Sharing(serve_groups("cpu", max_sessions=2)).share(0) == 2


def test_groups_that_do_not_fit_are_one_clear_error():
    with pytest.raises(
        InputError, match=r"5 worker group\(s\) of 1 GPU\(s\) at 2 per GPU need 3 GPUs; 2 visible"
    ):
        serve_groups("cuda", max_sessions=5, gpus=2, sessions_per_gpu=2)
    with pytest.raises(InputError, match="--sessions-per-gpu must be >= 1"):
        serve_groups("cuda", gpus=1, sessions_per_gpu=0)
    with pytest.raises(InputError, match="give one of them"):
        serve_groups("cpu", max_sessions=3, sessions_per_gpu=2)
    with pytest.raises(ConfigError, match="do not fit"):
        gpu_groups(1, 3, [0], per_gpu=2)

    class Fleet:  # another deployment places its own groups
        name = "ray"

        def placements(self, *a):
            return (Placement(("cuda:0",)),)

    with pytest.raises(InputError, match="the ray deployment places its own"):
        placements_from_args(Fleet(), "cuda", 1, None, None, 2)
    assert placements_from_args(Fleet(), "cuda", 1, None, None, None) == (Placement(("cuda:0",)),)


def test_the_config_types_what_its_groups_share_and_its_rules():
    from cadence.engine.recipe import EngineSpec

    cfg = ServeConfig(engine=EngineSpec(model="tiny"), groups=("cuda:0", "cuda:0", "cuda:1"), mps=True)
    assert cfg.sharing.share(0) == 2 and cfg.sharing.share(2) == 1
    assert cfg.share_rules == ShareRules("auto", 5.0, "error", True)
    with pytest.raises(ConfigError, match="capacity must be one of"):
        ServeConfig(engine=EngineSpec(model="tiny"), capacity="lots")
    with pytest.raises(ConfigError, match="memory_fit"):
        ServeConfig(engine=EngineSpec(model="tiny"), memory_fit="hope")
    auto, rep, groups = ShareRules(), ShareRules("report"), ShareRules("groups")
    assert auto.measures("cuda") and not auto.measures("cpu") and auto.enforces  # CPU groups: one each
    assert rep.measures("cpu") and not rep.enforces and not groups.measures("cuda")
    assert not ShareRules("measure", capacity_s=0).measures("cuda")


# ---- the arithmetic ------------------------------------------------------------------------------------------


def test_capacity_is_the_sessions_the_measured_throughput_holds_at_real_time():
    # 4 groups together made 3 chunks/s each; a chunk is 1.32 s of video: 15.84 sessions' worth / 1.05
    assert capacity_of([3.0] * 4, 1.32, 4) == 4  # at most its groups
    assert capacity_of([3.0] * 8, 0.5, 16) == math.floor(24 * 0.5 / 1.05) == 11  # below its groups
    assert capacity_of([1.0, 1.0, 1.0], 0.5, 3) == 1  # 1.5 sessions' worth with the margin: one
    assert capacity_of([2.1, 2.1], 0.5, 2) == 2 and capacity_of([2.0, 2.0], 0.5, 2) == 1  # the 5% margin
    assert capacity_of([0.1, 0.0], 0.5, 2) == 1  # a slow device still takes one session
    with pytest.raises(ValueError):
        capacity_of([1.0], 0.0, 1)


def test_memory_fit_counts_the_first_groups_footprint_plus_a_margin():
    fit = memory_fit(total_mb=143_000, free_mb=133_000)  # one group up: 10 GB in use
    assert fit.used_mb == 10_000 and fit.per_group_mb == pytest.approx(10_000 * (1 + MEMORY_MARGIN))
    assert fit.fits == 1 + math.floor(133_000 / 11_000) == 13
    small = memory_fit(total_mb=24_000, free_mb=10_000)  # 14 GB used: no second one fits
    assert small.fits == 1
    text = memory_error("cuda:0", "flashhead-pro", 16, fit)
    assert "\n" not in text and text.startswith("cuda:0 cannot hold 16 worker groups of flashhead-pro")
    assert (
        text.endswith("13 fit (--sessions-per-gpu 13)") and "9.8 GiB" in text and "129.9 GiB are free" in text
    )


# ---- admission on a shared GPU, on a fake clock ----------------------------------------------------------------


class _Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _manager(groups, capacity: int | None, enforced: bool = True, **kw):
    from cadence.engine.recipe import EngineSpec
    from cadence.serve.manager import SessionManager

    mgr = SessionManager(ServeConfig(engine=EngineSpec(model="tiny"), groups=groups, **kw))
    for g in mgr.groups:
        g.ready.set()
    for share in mgr.source.shares:
        share.capacity, share.enforced = capacity, enforced
    return mgr


def _stream(mgr, client, now: float, started_ago: float):
    """Admit ``client`` and put a streaming session of it on its group (created ``started_ago`` s before)."""
    g, sid = mgr.reserve(client)
    mgr.sessions[sid] = SimpleNamespace(
        sid=sid, state="streaming", ttff_ms=100.0, t_created=now - started_ago, last_activity=now
    )
    return g, sid


def test_a_full_gpu_refuses_with_a_retry_after_that_comes_true(monkeypatch):
    """Three groups on cuda:0 whose measured capacity is 2: a third session is refused though a group is
    free (503), told when the soonest session ends; coming back then, it is admitted on the group that freed."""
    from cadence.serve import manager as manager_mod
    from cadence.serve.guard import ApiError

    clock = _Clock()
    monkeypatch.setattr(manager_mod.time, "monotonic", clock)
    mgr = _manager(("cuda:0",) * 3, capacity=2, max_duration_s=600.0, idle_timeout_s=120.0)
    a, b, c = ("cookie:" + "a" * 22,), ("cookie:" + "b" * 22,), ("cookie:" + "c" * 22,)
    assert sum(g.free for g in mgr.groups) == 2  # what the GPU still takes, not its idle groups
    ga, sa = _stream(mgr, a, clock.t, started_ago=590.0)  # ends at its max duration in 10 s
    gb, sb = _stream(mgr, b, clock.t, started_ago=30.0)
    assert ga is not gb and sum(g.free for g in mgr.groups) == 0  # the third group is idle, not free
    with pytest.raises(ApiError) as e:
        mgr.reserve(c)
    assert e.value.status == 503 and "each GPU at its measured capacity" in e.value.message
    retry = int(e.value.headers["Retry-After"])
    assert retry == 10  # a's max duration: the soonest end
    clock.t += 5.0
    with pytest.raises(ApiError):  # early: still full
        mgr.reserve(c)
    clock.t += retry - 5.0  # when c was told: a ends now
    mgr.sessions.pop(sa)
    mgr.release(ga, sa)
    g, sid = mgr.reserve(c)
    assert g.session_id == sid and mgr.source.shares[0].busy() == 2
    # capacity reported, not enforced: every group takes a session
    rep = _manager(("cuda:0",) * 3, capacity=1, enforced=False)
    assert [rep.reserve((f"addr:10.0.0.{i}",))[0].index for i in range(3)] == [0, 1, 2]


def test_a_turn_on_a_full_gpu_is_kept_when_it_frees(monkeypatch):
    """Capacity 1 of 2 groups: B, refused while A streams, comes back when told; C, arriving at that moment
    first, is refused (the GPU takes one session, and it is B's turn), though an idle group is there too."""
    from cadence.serve import manager as manager_mod
    from cadence.serve.guard import ApiError

    clock = _Clock()
    monkeypatch.setattr(manager_mod.time, "monotonic", clock)
    mgr = _manager(("cuda:0",) * 2, capacity=1, idle_timeout_s=60.0)
    a, b, c = ("addr:10.0.0.1",), ("addr:10.0.0.2",), ("addr:10.0.0.3",)
    ga, sa = _stream(mgr, a, clock.t, started_ago=0.0)
    mgr.sessions[sa].last_activity = clock.t - 55.0  # idle: closed in 5 s
    with pytest.raises(ApiError) as e:
        mgr.reserve(b)
    assert e.value.headers["Retry-After"] == "5"
    clock.t += 5.0
    mgr.sessions.pop(sa)
    mgr.release(ga, sa)
    with pytest.raises(ApiError) as e:
        mgr.reserve(c)
    assert e.value.status == 503 and "held for clients refused before" in e.value.message
    g, _ = mgr.reserve(b)
    assert g.device == "cuda:0" and mgr.source.shares[0].busy() == 1


def test_sessions_spread_over_gpus_and_each_gpu_keeps_its_own_capacity(monkeypatch):
    from cadence.serve import manager as manager_mod
    from cadence.serve.guard import ApiError

    clock = _Clock()
    monkeypatch.setattr(manager_mod.time, "monotonic", clock)
    groups = serve_groups("cuda", gpus=2, sessions_per_gpu=2)  # cuda:0, cuda:1, cuda:0, cuda:1
    mgr = _manager(groups, capacity=1, idle_timeout_s=60.0)
    g1, s1 = _stream(mgr, ("addr:10.0.0.1",), clock.t, started_ago=0.0)
    g2, s2 = _stream(mgr, ("addr:10.0.0.2",), clock.t, started_ago=0.0)
    assert {g1.device, g2.device} == {"cuda:0", "cuda:1"}  # the second session went to the idle GPU
    mgr.sessions[s2].last_activity = clock.t - 50.0  # idle for 50 s: closed at 60
    with pytest.raises(ApiError) as e:
        mgr.reserve(("addr:10.0.0.3",))
    assert e.value.headers["Retry-After"] == "10"
    clock.t += 10.0
    mgr.sessions.pop(s2)
    mgr.release(g2, s2)
    g3, _ = mgr.reserve(("addr:10.0.0.3",))
    assert g3.device == g2.device  # room on the GPU that freed, not on the full one


# ---- the measurement and the staged start, with stand-in workers ---------------------------------------------


class _Gpu:
    """A time-shared device: one chunk at a time, ``chunk_s`` each (what k processes get without MPS)."""

    def __init__(self, chunk_s: float):
        self.chunk_s, self.busy_until = chunk_s, 0.0


class _FakeGroup:
    """A worker group seen from the event loop (what ``LocalGroups`` and ``measure_throughput`` use), its
    worker a coroutine on a shared :class:`_Gpu`."""

    def __init__(self, index: int, device: str, gpu: _Gpu | None = None, memory: dict | None = None):
        self.index, self.device, self.gpu = index, device, gpu
        self.ready, self.start_error, self.session_id = asyncio.Event(), None, None
        self.on_message, self.env, self.share, self.slots = None, {}, None, 3
        self.info = SimpleNamespace(audio_samples_per_chunk=800, gpu_memory=memory)
        self.spec = SimpleNamespace(
            recipe=SimpleNamespace(model="tiny", config=SimpleNamespace(chunk_seconds=0.1))
        )
        self.sent: list = []
        self.started_at: float | None = None
        self.fail: str | None = None  # the worker's start fails with this error (a test injects it)
        self.stopped = False

    stopping = False

    @property
    def free(self):
        return (
            self.ready.is_set()
            and self.session_id is None
            and (self.share is None or self.share.admits(self))
        )

    def start(self):
        loop = asyncio.get_running_loop()
        self.started_at = loop.time()
        if self.env.get("CUDA_MPS_PIPE_DIRECTORY") == "/broken":  # a daemon that serves no client
            loop.call_later(0.05, setattr, self, "start_error", "CUDA error: MPS client failed to connect")
        elif self.fail is not None:
            loop.call_later(0.05, setattr, self, "start_error", self.fail)
        else:
            loop.call_later(0.05, self.ready.set)

    async def stop(self, timeout: float = 10.0):
        self.ready.clear()
        self.start_error = None
        self.stopped = True

    def send(self, msg):
        self.sent.append(msg)
        loop = asyncio.get_running_loop()
        match msg:
            case OpenSession(sid=sid):
                loop.call_soon(self.on_message, Opened(sid, 1.0, True))
            case ChunkRequest(sid=sid, index=i):
                now = loop.time()
                self.gpu.busy_until = max(now, self.gpu.busy_until) + self.gpu.chunk_s
                loop.call_at(self.gpu.busy_until, self.on_message, ChunkDone(sid, i, None, ChunkTimings()))
            case CloseSession(sid=sid):  # after the chunks in flight, as the worker answers in order
                loop.call_at(max(loop.time(), self.gpu.busy_until) + 0.01, self.on_message, Closed(sid))


def test_the_groups_of_a_gpu_streaming_together_measure_its_throughput():
    from cadence.serve.workers import measure_throughput

    async def main():
        gpu = _Gpu(0.01)  # 100 chunks/s in all, however many groups share it
        groups = [_FakeGroup(i, "cuda:0", gpu) for i in range(3)]
        seen = []
        for g in groups:
            g.on_message = seen.append
            g.ready.set()
        rates = await measure_throughput(groups, seconds=0.5)
        assert len(rates) == 3 and min(rates) > 0
        assert 50 <= sum(rates) <= 105, rates  # never above what the device makes (loop jitter below it)
        for g in groups:
            kinds = [type(m).__name__ for m in g.sent]
            assert kinds[0] == "OpenSession" and kinds[-1] == "CloseSession" and "ChunkRequest" in kinds
            assert g.on_message == seen.append  # the server's handler back
        assert seen == []  # nothing of the measurement reached the server

    asyncio.run(main())


def test_the_first_group_of_a_shared_gpu_starts_alone_and_the_others_only_if_they_fit():
    from cadence.serve.workers import LocalGroups

    async def start(groups, rules):
        src = LocalGroups(
            groups, object, sharing=Sharing(tuple(Placement.of(g.device) for g in groups)), rules=rules
        )
        await src.start(lambda g, m: None, None, 10.0)
        return src

    def mem(free):
        return {"total_mb": 100_000.0, "free_mb": free}

    async def main():
        gpu = _Gpu(0.002)
        # 4 groups on cuda:0 (one uses 10 GB: 8 fit), 1 on cuda:1 (alone: starts with the first)
        groups = [_FakeGroup(i, "cuda:0", gpu, mem(90_000.0)) for i in range(4)] + [_FakeGroup(4, "cuda:1")]
        src = await start(groups, ShareRules("measure", capacity_s=0.2))
        t = [g.started_at for g in groups]
        assert abs(t[0] - t[4]) < 0.01 and min(t[1:4]) >= t[0] + 0.05  # the others after the first was ready
        (share,) = src.shares
        assert share.memory["fits"] == 9 and share.capacity is not None and share.measured["capacity"] >= 1
        # too many for the memory: one error line, or (trim) only those that fit
        groups = [_FakeGroup(i, "cuda:0", gpu, mem(25_000.0)) for i in range(5)]  # 75 GB used: 1 fits
        with pytest.raises(RuntimeError, match=r"cuda:0 cannot hold 5 worker groups of tiny: .* 1 fit"):
            await start(groups, ShareRules())
        groups = [_FakeGroup(i, "cuda:0", gpu, mem(180_000.0 / 3)) for i in range(5)]  # 40 GB: 2 fit
        src = await start(list(groups), ShareRules("groups", memory_fit="trim"))
        assert [g.index for g in src.groups] == [0, 1] and groups[2].started_at is None
        assert src.shares[0].capacity is None  # 'groups': not measured

    asyncio.run(main())


#: What a worker that ran out of memory at start reports (its text as ``cadence.engine.worker`` sends it).
_OOM = (
    "worker start failed: AcceleratorError: CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in "
    "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.\nCUDA kernel "
    "errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect."
    "\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable "
    "device-side assertions.\n"
)


def test_a_further_group_out_of_memory_at_start_is_left_out_and_the_rest_serve(caplog):
    from cadence.serve.workers import LocalGroups

    def mem():
        return {"total_mb": 100_000.0, "free_mb": 90_000.0}  # 8 more fit, by the estimate

    async def main():
        gpu = _Gpu(0.002)
        groups = [_FakeGroup(i, "cuda:0", gpu, mem()) for i in range(5)] + [_FakeGroup(5, "cuda:1", gpu)]
        src = LocalGroups(
            list(groups),
            object,
            sharing=Sharing(tuple(Placement.of(g.device) for g in groups)),
            rules=ShareRules("measure", capacity_s=0.2),
        )
        for g in groups[2], groups[4]:  # their warm-ups ran out of the GPU's memory
            g.fail = one_line(_OOM)
        with caplog.at_level(logging.WARNING, logger="cadence.serve"):
            await src.start(lambda g, m: None, None, 10.0)
        assert [g.index for g in src.groups] == [0, 1, 3, 5]
        assert groups[2].stopped and groups[4].stopped and groups[2].share is None
        (share,) = src.shares
        assert [g.index for g in share.groups] == [0, 1, 3] and share.left_out == 2
        # the capacity is measured on the 3 that serve, and admission keeps to it
        assert 1 <= share.capacity <= 3 and len(share.measured["chunks_per_s"]) == 3
        assert share.describe()["groups"] == 3 and share.describe()["left_out"] == 2
        lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
        assert len(lines) == 2 and all("\n" not in line for line in lines)
        assert "worker 2 (cuda:0) left out: it ran out of GPU memory" in lines[0]
        assert "CUDA error: out of memory" in lines[0] and "cudaErrorMemoryAllocation" not in lines[0]
        assert lines[1].endswith("3 group(s) serve on cuda:0")
        assert sum(g.free for g in src.groups) == share.capacity + 1  # (cuda:1's own group besides)

    asyncio.run(main())


def test_the_first_groups_failure_or_any_other_failure_still_stops_the_start_in_one_line():
    from cadence.serve.workers import LocalGroups

    async def start(groups):
        src = LocalGroups(
            groups, object, sharing=Sharing(tuple(g.device for g in groups)), rules=ShareRules(capacity_s=0.2)
        )
        await src.start(lambda g, m: None, None, 10.0)

    async def main():
        gpu = _Gpu(0.002)
        mem = {"total_mb": 100_000.0, "free_mb": 90_000.0}
        groups = [_FakeGroup(i, "cuda:0", gpu, mem) for i in range(3)]
        groups[0].fail = one_line(_OOM)  # the first: nothing to measure others by
        with pytest.raises(RuntimeError) as e:
            await start(groups)
        assert (
            str(e.value)
            == "worker 0 (cuda:0): worker start failed: AcceleratorError: CUDA error: out of memory"
        )
        assert groups[1].started_at is None
        groups = [_FakeGroup(i, "cuda:0", gpu, mem) for i in range(3)]
        groups[2].fail = "worker start failed: ValueError: frame ring shape [1] != the engine's [2]"
        with pytest.raises(RuntimeError, match=r"^worker 2 \(cuda:0\): worker start failed: ValueError"):
            await start(groups)

    asyncio.run(main())


def test_an_error_line_keeps_what_went_wrong_and_drops_cudas_boilerplate():
    assert one_line(_OOM) == "worker start failed: AcceleratorError: CUDA error: out of memory"
    assert one_line("a\n  b\n") == "a b"
    assert out_of_memory(_OOM) and out_of_memory(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"
    )
    assert not out_of_memory("CUDA error: MPS client failed to connect")
    from cadence.engine.messages import Error
    from cadence.serve.workers import WorkerGroup

    g = WorkerGroup(3, SimpleNamespace())  # the web side keeps one line, whatever the worker sent
    g._dispatch(Error(None, _OOM))
    assert g.start_error == "worker start failed: AcceleratorError: CUDA error: out of memory"


# ---- MPS ---------------------------------------------------------------------------------------------------


def test_workers_that_cannot_start_under_mps_start_without_it(monkeypatch, caplog):
    from cadence.serve import mps
    from cadence.serve.workers import LocalGroups

    stopped = []
    daemon = SimpleNamespace(env={"CUDA_MPS_PIPE_DIRECTORY": "/broken"}, stop=lambda: stopped.append(1))
    monkeypatch.setattr(mps.MpsDaemon, "start", classmethod(lambda cls: daemon))

    async def main():
        gpu = _Gpu(0.002)
        groups = [
            _FakeGroup(i, "cuda:0", gpu, {"total_mb": 100_000.0, "free_mb": 90_000.0}) for i in range(2)
        ]
        src = LocalGroups(
            groups, object, sharing=Sharing(("cuda:0", "cuda:0")), rules=ShareRules(capacity_s=0.2, mps=True)
        )
        with caplog.at_level(logging.WARNING, logger="cadence.serve"):
            await src.start(lambda g, m: None, None, 10.0)
        assert all(g.ready.is_set() and g.env == {} for g in groups) and src.mps is None and stopped == [1]
        (line,) = [r.getMessage() for r in caplog.records]
        assert "did not start under MPS" in line and "MPS client failed to connect" in line

    asyncio.run(main())


def _fake_mps(tmp_path, rc: int = 0):
    """A stand-in nvidia-cuda-mps-control: logs its arguments, pipe folder and stdin; lists one server."""
    log = tmp_path / "calls.log"
    exe = tmp_path / "nvidia-cuda-mps-control"
    exe.write_text(
        "#!/bin/sh\n"
        f'echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY" >> {log}\n'
        f'if [ "$1" != "-d" ]; then read cmd; echo "cmd=$cmd" >> {log}; fi\n'
        '[ "$cmd" = get_server_list ] && echo 4242\n'
        f"exit {rc}\n"
    )
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe), log


def test_mps_runs_a_private_daemon_and_quits_it(tmp_path):
    from cadence.serve.mps import MpsDaemon

    exe, log = _fake_mps(tmp_path)
    d = MpsDaemon.start(exe)
    assert d is not None and os.path.isdir(d.env["CUDA_MPS_PIPE_DIRECTORY"])
    assert (
        d.env["CUDA_MPS_PIPE_DIRECTORY"].startswith(str(d.folder))
        and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    )
    assert d.servers() == ["4242"] and d.describe()["servers"] == ["4242"]
    d.stop()
    d.stop()  # idempotent
    pipe = d.env["CUDA_MPS_PIPE_DIRECTORY"]
    ask = [f"args= pipe={pipe}", "cmd=get_server_list"]
    assert log.read_text().splitlines() == [
        f"args=-d pipe={pipe}",
        *ask,
        *ask,
        f"args= pipe={pipe}",
        "cmd=quit",
    ]
    assert not d.folder.exists()


def test_mps_absent_or_failing_is_one_warning_and_no_daemon(tmp_path, caplog, monkeypatch):
    from cadence.serve import mps

    monkeypatch.setattr(mps.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="cadence.serve"):
        assert mps.MpsDaemon.start() is None
        exe, _ = _fake_mps(tmp_path, rc=1)
        assert mps.MpsDaemon.start(exe) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "not installed" in lines[0] and "did not start" in lines[1]
    assert not list(tmp_path.glob("cadence-mps-*"))


def test_a_worker_process_gets_its_environment_before_it_imports_anything(monkeypatch):
    from cadence.serve import workers

    got = {}

    def entry(*args):
        got["args"], got["env"] = args, os.environ.get("CADENCE_TEST_MPS_PIPE")

    monkeypatch.delenv("CADENCE_TEST_MPS_PIPE", raising=False)
    monkeypatch.setattr(workers.importlib, "import_module", lambda name: SimpleNamespace(worker_main=entry))
    try:
        workers._spawned("worker_main", {"CADENCE_TEST_MPS_PIPE": "/tmp/x"}, 1, "spec")
    finally:
        os.environ.pop("CADENCE_TEST_MPS_PIPE", None)
    assert got == {"args": (1, "spec"), "env": "/tmp/x"}


# ---- two groups on one device, two sessions at once (the tiny preset on the CPU) ------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_groups_on_one_device_stream_two_sessions_each_from_its_own_state(monkeypatch):
    """Two worker groups on 'cpu' (as --sessions-per-gpu 2 places two on a GPU): the capacity measured with
    both streaming (reported), then two sessions at once, one per group (two processes), each with its own
    reference image; then the first again alone on the same group: its first chunks equal what it made beside
    the other (a session's stream depends on nothing but its own inputs)."""
    pytest.importorskip("aiortc")
    pytest.importorskip("prometheus_client")
    import multiprocessing

    from PIL import Image

    from cadence.engine.recipe import EngineSpec
    from cadence.serve.manager import SessionManager
    from cadence.serve.session import LiveSession

    chunks: dict[str, dict[int, np.ndarray]] = {}
    real = LiveSession.on_chunk

    def spy(self, c, frames, timings):
        chunks.setdefault(self.sid, {})[c] = np.array(frames, copy=True)
        real(self, c, frames, timings)

    monkeypatch.setattr(LiveSession, "on_chunk", spy)
    viewers: list[asyncio.Task] = []
    faces = []
    for color in ((200, 60, 40), (30, 90, 220)):
        buf = io.BytesIO()
        Image.new("RGB", (96, 80), color).save(buf, format="PNG")
        faces.append(buf.getvalue())

    async def watch(sess):  # a viewer: the media clock runs while a track is read
        from aiortc.mediastreams import MediaStreamError

        with contextlib.suppress(MediaStreamError):
            while True:
                await sess.video.next_frame()

    async def open_and_wait(mgr, image, seed):
        sess = await mgr.create_local(mgr.new_agent("mirror"), image=image, seed=seed)
        viewers.append(asyncio.create_task(watch(sess)))
        for _ in range(400):
            if len(chunks.get(sess.sid, {})) >= 2:
                break
            await asyncio.sleep(0.05)
        return sess

    async def main():
        cfg = ServeConfig(
            engine=EngineSpec(model="tiny"), groups=("cpu", "cpu"), capacity="report", capacity_s=1.0, port=0
        )
        mgr = SessionManager(cfg)
        await mgr.start()
        images = [await mgr.decode_image(f) for f in faces]
        try:
            (share,) = mgr.source.shares
            assert (
                share.measured["capacity"] == share.capacity >= 1 and len(share.measured["chunks_per_s"]) == 2
            )
            assert min(share.measured["chunks_per_s"]) > 0 and not share.enforced
            a = await open_and_wait(mgr, images[0], 1)
            b = await open_and_wait(mgr, images[1], 2)
            assert a.group is not b.group and a.group.pid != b.group.pid  # two processes, two engines
            info = a.group.info_dict()  # what /config lists per worker
            assert info["share"]["groups"] == 2 and info["share"]["busy"] == 2 and info["mps"] is False
            assert info["gpu_memory"] is None  # (a CPU group)
            assert a.state == b.state == "streaming"
            await asyncio.sleep(1.0)  # both streaming at once
            for s in (a, b):
                assert len(chunks[s.sid]) >= 3, {k: len(v) for k, v in chunks.items()}
            assert not np.array_equal(chunks[a.sid][0], chunks[b.sid][0])
            first_group = a.group
            await a.close("done")
            await b.close("done")
            a2 = await open_and_wait(mgr, images[0], 1)
            assert a2.group is first_group
            for c in (0, 1):  # the chunks planned before the clock: always generated, in order
                np.testing.assert_array_equal(chunks[a2.sid][c], chunks[a.sid][c])
            await a2.close("done")
        finally:
            await mgr.stop()
            for t in viewers:
                t.cancel()

    asyncio.run(main())
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    "words, says",
    [
        (["--sessions-per-gpu", "0"], "--sessions-per-gpu must be >= 1, got 0"),
        (
            ["--sessions-per-gpu", "2", "--max-sessions", "3"],
            "--max-sessions 3 groups on the CPU (one device) at --sessions-per-gpu 2: give one of them",
        ),
        (["--sessions-per-gpu", "2", "--capacity", "lots"], None),  # argparse's own usage error
    ],
)
def test_serve_says_what_is_wrong_with_the_sharing_words_in_one_line(capsys, words, says):
    from cadence.cli import main

    try:
        rc = main(["serve", *words])
    except SystemExit as e:  # argparse: a usage line and status 2
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    if says is not None:
        assert err.strip().splitlines() == [f"error: {says}"], err
    else:
        assert "invalid choice: 'lots'" in err


def test_workers_sharing_a_gpu_keep_a_fair_share_of_the_cores_as_torch_threads():
    from cadence.engine.placement import gpu_worker_threads
    from cadence.engine.recipe import EngineSpec
    from cadence.serve.config import LOCAL

    assert gpu_worker_threads(4, 16, 16) == 1 and gpu_worker_threads(4, 16, 4) == 4  # never above torch's own
    assert gpu_worker_threads(4, 16, 5) == 3 and gpu_worker_threads(4, 2, 16) == 1
    shared = ServeConfig(engine=EngineSpec(model="tiny"), groups=("cuda:0",) * 4 + ("cuda:1",))
    src = LOCAL.group_source(shared)
    assert [g.spec.cpu_share for g in src.groups] == [5] * 5  # five worker processes on this machine
    alone = ServeConfig(engine=EngineSpec(model="tiny"), groups=("cuda:0", "cuda:1"))
    assert [g.spec.cpu_share for g in LOCAL.group_source(alone).groups] == [1, 1]  # torch's default kept


def test_a_cuda_worker_sets_its_share_of_threads_at_start_and_an_explicit_count_wins(monkeypatch):
    import signal

    import torch

    from cadence.engine import worker

    set_to = []
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # (the test process keeps its own handlers)
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(worker.os, "cpu_count", lambda: 16)

    def spec(threads, share):
        fast = SimpleNamespace(threads=threads)
        return SimpleNamespace(recipe=SimpleNamespace(device="cuda:0", fast=fast), cpu_share=share)

    worker._setup_process(spec(0, 16), "t")
    worker._setup_process(spec(0, 1), "t")  # alone on its GPU: torch's default
    worker._setup_process(spec(2, 16), "t")  # --worker-threads 2
    assert set_to == [1, 2]
