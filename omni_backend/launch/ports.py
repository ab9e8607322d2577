"""Free TCP ports for servers started beside others (tests, benchmarks, the soak and README smoke steps)."""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on localhost right now (the OS picks them; another process may still take
    one before the caller binds it)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
