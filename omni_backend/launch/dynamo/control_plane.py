"""Dynamo's discovery and event plane on this machine: the etcd and NATS command lines for one local deployment, and
the wait until both answer before the frontend and workers (which fail at start without them) are started.
Used by launch/dynamo/local.py and scripts/bench_scale.py.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.3


def etcd_command(etcd: str, data_dir: Path, client_port: int, peer_port: int, name: str = "default") -> list[str]:
    """A single-member etcd on localhost (`client_port` for clients, `peer_port` for its own raft), data in
    `data_dir`."""
    return [etcd, "--name", name, "--data-dir", str(data_dir),
            "--listen-client-urls", f"http://127.0.0.1:{client_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"{name}=http://127.0.0.1:{peer_port}"]


def nats_command(nats_server: str, store_dir: Path, port: int) -> list[str]:
    """A NATS server on localhost:`port` with JetStream (`-js`): Dynamo's KV router keeps its snapshots in a NATS
    object store (in `store_dir`)."""
    return [nats_server, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store_dir)]


def wait_etcd_and_nats(etcd_port: int, nats_port: int, timeout_s: float, check_alive: Callable[[], None],
                       stop: threading.Event | None = None) -> None:
    """Until etcd's `/health` answers 200 on localhost:`etcd_port` and NATS accepts TCP on localhost:`nats_port`.

    Args:
        check_alive: called every POLL_S; raises when a process being waited for has exited.

    Raises:
        RuntimeError: not both within `timeout_s` (naming which), or `stop` was set (Ctrl-C during startup);
            what `check_alive` raises.
    """
    deadline = time.monotonic() + timeout_s
    stop = stop or threading.Event()
    waiting = {"etcd": lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"), "NATS": lambda: _accepts(nats_port)}
    while True:
        waiting = {name: ready for name, ready in waiting.items() if not ready()}
        if not waiting:
            return
        check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{' and '.join(waiting)} not answering within {timeout_s:.0f} s")
        if stop.wait(POLL_S):
            raise RuntimeError("stopped while waiting for etcd and NATS")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False
