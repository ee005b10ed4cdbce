"""Small host networking helpers, free of torch (the server's web process imports this)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A free TCP port on loopback, for a process group's rendezvous (MASTER_PORT) on one host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
