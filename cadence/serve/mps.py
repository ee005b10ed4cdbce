"""A private CUDA MPS control daemon for a server's worker processes (``cadence serve --mps``).

Without MPS, the processes of several worker groups on one GPU time-share it: the GPU runs one process's
kernels at a time, switching between them; a model whose kernels leave most of the GPU idle (a 1.3B DiT at
batch one) leaves it idle for each of them. Under MPS (the Multi-Process Service) their kernels run on the GPU
at the same time, from one shared context.

The server starts its own control daemon (``nvidia-cuda-mps-control -d``) with its own pipe and log folders
(a fresh temporary folder: ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``), gives the worker
processes those two variables (``env``: set in each spawned worker before it imports torch; never in the web
process, which runs no CUDA), and asks the daemon to quit when the server stops (``quit``). Nothing about the
GPU is changed: not its compute mode (MPS clients share a GPU in the default mode too), not its clocks, and a
daemon already running for the machine (``/tmp/nvidia-mps``) is left alone. When the binary is not there or
the daemon does not start, :meth:`MpsDaemon.start` says so in one log line and returns None: the workers
time-share the GPU as without ``--mps``; a daemon that starts but whose clients cannot start (the workers fail
to come up under it) is stopped and the workers started again without it, also with one log line
(``cadence.serve.workers.LocalGroups``).

By hand, the same for any command (the workers inherit the variables)::

    export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
    nvidia-cuda-mps-control -d
    cadence serve --device cuda --sessions-per-gpu 8 ...
    echo quit | nvidia-cuda-mps-control
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("cadence.serve")

BINARY = "nvidia-cuda-mps-control"


@dataclass
class MpsDaemon:
    """A running control daemon of ours: ``env`` for the clients, ``stop()`` to end it (idempotent)."""

    binary: str
    folder: Path
    env: dict[str, str] = field(default_factory=dict)
    stopped: bool = False

    @classmethod
    def start(cls, binary: str | None = None, timeout_s: float = 10.0) -> MpsDaemon | None:
        """Start one (None, and one WARNING line, when it cannot: plain time-sharing then)."""
        path = binary or shutil.which(BINARY)
        if path is None:
            log.warning("--mps: %s is not installed: the workers time-share the GPU without MPS", BINARY)
            return None
        folder = Path(tempfile.mkdtemp(prefix="cadence-mps-"))
        env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(folder / "log"),
        }
        for d in env.values():
            Path(d).mkdir()
        daemon = cls(path, folder, env)
        try:
            r = subprocess.run(
                [path, "-d"], env=daemon._env(), capture_output=True, text=True, timeout=timeout_s
            )
            ok, why = r.returncode == 0, (r.stderr or r.stdout).strip()[:200] or f"exit status {r.returncode}"
        except (OSError, subprocess.SubprocessError) as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        if not ok:
            shutil.rmtree(folder, ignore_errors=True)
            log.warning(
                "--mps: the MPS control daemon did not start (%s): the workers time-share the GPU", why
            )
            return None
        log.info("MPS: control daemon started (pipe %s)", env["CUDA_MPS_PIPE_DIRECTORY"])
        return daemon

    def _env(self) -> dict[str, str]:
        import os

        return {**os.environ, **self.env}

    def control(self, command: str, timeout_s: float = 10.0) -> str | None:
        """One command to the daemon (``get_server_list``, ``quit``, ...): its answer, or None if it failed."""
        try:
            r = subprocess.run(
                [self.binary],
                input=command + "\n",
                env=self._env(),
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    def servers(self) -> list[str]:
        """The MPS servers the daemon runs (one per user of a GPU once a client connected; [] before)."""
        out = self.control("get_server_list")
        return out.split() if out else []

    def stop(self) -> None:
        """Ask the daemon to quit (it ends its servers once their clients are gone), then remove its folder."""
        if self.stopped:
            return
        self.stopped = True
        if self.control("quit") is None:
            log.warning(
                "MPS: the control daemon did not take 'quit' (pipe %s)", self.env["CUDA_MPS_PIPE_DIRECTORY"]
            )
        shutil.rmtree(self.folder, ignore_errors=True)

    def describe(self) -> dict:
        """For ``/config``: the pipe folder and the servers running."""
        return {"pipe": self.env["CUDA_MPS_PIPE_DIRECTORY"], "servers": self.servers()}
