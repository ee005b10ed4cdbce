"""A Ray cluster of ``ray start`` processes on this machine, loopback only: the tests' (a head and a second
"node") and ``cadence bench serve --ray local``'s.

Each node is one ``ray start --block`` process in a process group of its own, so stopping a node ends
exactly its processes (its raylet and the workers it started), never another Ray on the machine: SIGTERM
(Ray drains the node), then SIGKILL to the group after ``grace_s``. The head's files go to a temporary
directory of their own (``--temp-dir``), removed at ``stop``. The nodes' workers import this checkout of
cadence (its root goes first on their ``PYTHONPATH``); a real cluster installs cadence on every node.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

from cadence.fleet.names import NAMESPACE, REGISTRY_NAME
from cadence.net import free_port

#: ``RAY_max_direct_call_object_size`` for the nodes started here (Ray's default is 100 KiB).
INLINE_REPLY_BYTES = 1 << 20


class LocalNode:
    def __init__(self, proc: subprocess.Popen, log_path: str, name: str):
        self.proc, self.log_path, self.name = proc, log_path, name

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the node's process group, SIGKILL it after ``grace_s``."""
        if self.proc.poll() is not None:
            self._kill_group()
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        self._kill_group()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""


class LocalCluster:
    """``head = LocalCluster(num_cpus=1).start()``; ``add_node(num_cpus=1)``; ``stop()``."""

    def __init__(self, num_cpus: float = 1, object_store_mb: int = 200, resources: dict | None = None):
        self.num_cpus, self.object_store_mb, self.resources = num_cpus, object_store_mb, resources or {}
        self.temp_dir = tempfile.mkdtemp(prefix="cadence-ray-")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[LocalNode] = []
        # the nodes' workers import this checkout of cadence (installed or not)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=path)
        # a chunk's frames under 1 MiB come back inline in the poll's reply, not through the object store
        # (measured here, two character sessions: the raylets' CPU 6.0% -> 1.2% of a core; docs/fleet.md)
        self.env.setdefault("RAY_max_direct_call_object_size", str(INLINE_REPLY_BYTES))
        # Ray starts its workers at nice 15 (worker_niceness): a group's engine would then lose the CPU to
        # anything else on the node; a live stream's worker runs at normal priority, as on one machine
        self.env.setdefault("RAY_worker_niceness", "0")

    def _ray_start(self, args: list[str], name: str) -> LocalNode:
        log_path = os.path.join(self.temp_dir, f"{name}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                ["ray", "start", "--block", "--node-ip-address", "127.0.0.1", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        node = LocalNode(proc, log_path, name)
        self.nodes.append(node)
        return node

    def _common(self, num_cpus: float, resources: dict | None) -> list[str]:
        out = ["--num-cpus", str(num_cpus), "--object-store-memory", str(self.object_store_mb * 2**20)]
        if resources:
            out += ["--resources", json.dumps(resources)]
        return out

    def start(self, timeout_s: float = 90.0) -> LocalCluster:
        self._ray_start(
            [
                "--head",
                "--port",
                str(self.port),
                "--temp-dir",
                self.temp_dir,
                "--include-dashboard",
                "false",
                "--disable-usage-stats",
                *self._common(self.num_cpus, self.resources),
            ],
            "head",
        )
        self._wait_started(self.nodes[-1], timeout_s)
        return self

    def add_node(
        self, num_cpus: float = 1, resources: dict | None = None, timeout_s: float = 90.0
    ) -> LocalNode:
        node = self._ray_start(
            ["--address", self.address, *self._common(num_cpus, resources)], f"node{len(self.nodes)}"
        )
        self._wait_started(node, timeout_s)
        return node

    def _wait_started(self, node: LocalNode, timeout_s: float) -> None:
        """Until ``ray start`` says the node runs ("Ray runtime started"), or it exits, or the timeout."""
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in node.log_tail(1 << 20):
            if not node.alive:
                raise RuntimeError(f"ray node {node.name} exited: {node.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"ray node {node.name} did not start in {timeout_s:.0f} s: {node.log_tail()}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
        self.nodes = []
        for _ in range(3):  # (a Ray process that is still exiting may write its session folder again)
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            time.sleep(0.5)
            if not os.path.exists(self.temp_dir):
                break

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """The end of a test's or a benchmark's fleet: the fleet's groups removed through its registry (when
        this process is connected to Ray and a registry exists), Ray disconnected, then the nodes stopped."""
        try:
            import ray
        except ModuleNotFoundError:  # pragma: no cover - the cluster itself needs ray
            ray = None
        try:
            if ray is not None and ray.is_initialized():
                try:
                    reg = ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
                    ray.get(reg.remove_all.remote(), timeout=timeout_s)
                except Exception:  # no registry (never made, or gone with its node): no group left to remove
                    pass
                ray.shutdown()
        finally:
            self.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
