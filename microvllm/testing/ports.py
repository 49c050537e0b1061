"""Free TCP ports on 127.0.0.1."""

from __future__ import annotations

import socket


def free_port() -> int:
    """One free port (the OS may hand it to someone else before you bind it: take several
    that must differ with ``free_ports``)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` different free ports: each socket stays bound until all are chosen (one
    ``free_port()`` after another may be handed the same port twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
