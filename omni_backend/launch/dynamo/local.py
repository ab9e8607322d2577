"""A Dynamo deployment on this machine: etcd, NATS, Dynamo's frontend and N of our workers, each a child process on
free local ports (`scripts/serve_dynamo.sh N`, and the end-to-end test).

`python -m omni_backend.launch.dynamo.local N` serves until Ctrl-C/SIGTERM (also during startup) and then stops
everything it started, the frontend first. On a machine with GPUs each worker gets a GPU of its own
(`CUDA_VISIBLE_DEVICES`); the logs stay in `<cache>/dynamo/logs/<start time>-*/` after the stop. The frontend runs in its own venv (`scripts/setup.sh --dynamo` makes it: requirements-dynamo-
frontend.txt), the workers in this interpreter's (the project venv, with requirements-dynamo.txt).
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from omni_backend import paths
from omni_backend.launch.dynamo.control_plane import (
    etcd_command,
    nats_command,
    wait_etcd_and_nats,
)
from omni_backend.launch.ports import free_ports
from omni_backend.ops.torch_flavor import nvidia_driver

ROUTER_MODES = ("kv", "round-robin")
STOP_TIMEOUT_S = 30.0
CONTROL_PLANE_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 30


def frontend_python() -> Path:
    """The frontend venv's interpreter (`<cache>/dynamo-frontend`)."""
    return paths.cache_dir() / "dynamo-frontend" / "bin" / "python"


def find_binary(name: str) -> str:
    """`name` on PATH or in /usr/sbin (Debian's nats-server is there, often not on a user's PATH).

    Raises:
        FileNotFoundError: neither has it (scripts/setup.sh --dynamo installs etcd-server and nats-server).
    """
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    if found is None:
        raise FileNotFoundError(f"{name} not found: run scripts/setup.sh --dynamo (Debian packages etcd-server, "
                                f"nats-server)")
    return found


@dataclass
class LocalDynamo:
    """The processes of one local deployment.

    Args:
        model: the served folder (every worker serves it; clients name it as `model`).
        workers: how many workers.
        router_mode: the frontend's `--router-mode` (`ROUTER_MODES`).
        http_port: the frontend's OpenAI port (0: a free one).
        settings: engine settings for every worker (`--setting NAME=VALUE`).
        log_dir: where each process's output goes (`<name>.log`); None: a new folder under `<cache>/dynamo/logs`.
            It is kept after `stop`.
        stop_event: set it (a signal handler) to end `start` early, with RuntimeError.

    Attributes:
        workers_health: each worker's Dynamo system port (`/health`, `/live`), in start order.
    """

    model: str
    workers: int = 2
    router_mode: str = "kv"
    http_port: int = 0
    settings: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    stop_event: threading.Event = field(default_factory=threading.Event)
    workers_health: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.router_mode not in ROUTER_MODES:
            raise ValueError(f"router mode must be one of {', '.join(ROUTER_MODES)}, got {self.router_mode!r}")
        if self.workers < 1:
            raise ValueError(f"need at least one worker, got {self.workers}")
        self.env = dict(os.environ)
        if self.workers > 1 and (self.env.get("OMNI_KV_EVENTS") or self.settings.get("kv_events")):
            # one endpoint for N workers: the second bind fails (tcp) or takes the first's socket over (ipc)
            raise ValueError(f"kv_events (OMNI_KV_EVENTS) names one endpoint, but each of the {self.workers} workers "
                             f"binds its own stream; unset it (every worker then publishes on an ipc socket of its own)")
        driver = nvidia_driver()
        self.devices = worker_devices(self.workers, driver.gpus if driver else 0, self.env.get("CUDA_VISIBLE_DEVICES"))
        self._folder = tempfile.TemporaryDirectory(prefix="omni-dynamo-local-")  # etcd's and NATS's data
        if self.log_dir is None:
            logs = paths.cache_dir() / "dynamo" / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            self.log_dir = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=logs)
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        self._processes: list[tuple[str, subprocess.Popen]] = []

    @property
    def base_url(self) -> str:
        """The frontend's OpenAI base URL (for `openai.OpenAI(base_url=...)`)."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    def _spawn(self, name: str, command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(Path(self.log_dir) / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it)
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env or self.env,
                                   start_new_session=True)  # Ctrl-C reaches this launcher, which stops them in order
        log.close()
        self._processes.append((name, process))
        return process

    def log(self, name: str) -> str:
        """What process `name` (etcd, nats, frontend, worker0, ...) wrote so far."""
        return (Path(self.log_dir) / f"{name}.log").read_text(errors="replace")

    def tail(self, name: str, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of process `name`'s log, headed by the log's path."""
        path = Path(self.log_dir) / f"{name}.log"
        return f"{path} ends with:\n" + "\n".join(self.log(name).splitlines()[-lines:])

    def start(self, ready_timeout_s: float = 600.0) -> LocalDynamo:
        """Start everything and wait until the frontend lists the model with every worker healthy.

        Raises:
            FileNotFoundError: etcd, nats-server or the frontend venv missing; RuntimeError: a process exited, the
                deployment was not ready within `ready_timeout_s` or `stop_event` was set (everything started is
                stopped again).
        """
        try:
            self._start(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, ready_timeout_s: float) -> None:
        etcd_client, etcd_peer, nats, http = free_ports(4)
        health = system_ports(self.workers)
        self.http_port = self.http_port or http
        data = Path(self._folder.name)
        self._spawn("etcd", etcd_command(find_binary("etcd"), data / "etcd", etcd_client, etcd_peer))
        self._spawn("nats", nats_command(find_binary("nats-server"), data / "nats", nats))
        wait_etcd_and_nats(etcd_client, nats, CONTROL_PLANE_TIMEOUT_S, self._check_alive, self.stop_event)
        self.env.update(ETCD_ENDPOINTS=f"http://127.0.0.1:{etcd_client}", NATS_SERVER=f"nats://127.0.0.1:{nats}",
                        HF_HUB_OFFLINE="1")
        frontend = frontend_python()
        if not frontend.exists():
            raise FileNotFoundError(f"{frontend} is missing: run scripts/setup.sh --dynamo")
        self._spawn("frontend", [str(frontend), "-m", "dynamo.frontend", "--router-mode", self.router_mode,
                                 "--http-host", "127.0.0.1", "--http-port", str(self.http_port)])
        settings = [arg for name, value in self.settings.items() for arg in ("--setting", f"{name}={value}")]
        for index, (port, device) in enumerate(zip(health, self.devices)):
            env = dict(self.env, DYN_SYSTEM_ENABLED="true", DYN_SYSTEM_PORT=str(port))
            if device is not None:
                env["CUDA_VISIBLE_DEVICES"] = device
            self._spawn(f"worker{index}", [sys.executable, "-m", "omni_backend.launch.dynamo", "--model", self.model,
                                           *settings], env)
            self.workers_health.append(port)
        self._wait_ready(ready_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            if all(_answers(f"http://127.0.0.1:{port}/health") for port in self.workers_health) and \
                    self.model in _answers(f"http://127.0.0.1:{self.http_port}/v1/models"):
                return
            if self.stop_event.wait(1.0):
                raise RuntimeError("stopped before the deployment was ready")
        raise RuntimeError(f"the Dynamo deployment was not ready within {timeout_s:.0f} s")

    def _check_alive(self) -> None:
        name = self.exited()
        if name is not None:
            raise RuntimeError(f"{name} exited with code {dict(self._processes)[name].returncode}; {self.tail(name)}")

    def exited(self) -> str | None:
        """The name of a process that has exited, None while all run."""
        return next((name for name, process in self._processes if process.poll() is not None), None)

    def stop(self) -> None:
        """SIGTERM each process, the frontend first (no new requests), then the workers, NATS and etcd (each may
        drain up to STOP_TIMEOUT_S), then SIGKILL. The logs stay."""
        rest = [named for named in reversed(self._processes) if named[0] != "frontend"]
        for _, process in [named for named in self._processes if named[0] == "frontend"] + rest:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self._processes.clear()
        self._folder.cleanup()


def worker_devices(workers: int, gpus: int, visible: str | None) -> list[str | None]:
    """Each worker's `CUDA_VISIBLE_DEVICES`: a GPU of its own, as each engine takes gpu_memory_utilization of the
    GPU it sees.

    Args:
        gpus: how many GPUs NVML counts (0: none, or no NVML).
        visible: this process's `CUDA_VISIBLE_DEVICES` (None: unset); when set, the workers share out its entries.

    Returns:
        `workers` device strings, or `workers` Nones on a machine without GPUs (the environment stays as it is).

    Raises:
        ValueError: more workers than GPUs.
    """
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else \
        [str(index) for index in range(gpus)]
    if gpus == 0 or not devices:
        return [None] * workers
    if workers > len(devices):
        raise ValueError(f"{workers} workers need a GPU each, but {len(devices)} GPU(s) are visible "
                         f"({', '.join(devices)}); start at most {len(devices)}")
    return devices[:workers]


def system_ports(count: int, low: int = 20000) -> list[int]:
    """`count` TCP ports free on localhost now, in `low`..32767: Dynamo 1.6 reads `DYN_SYSTEM_PORT` as a signed
    16-bit integer, so the OS's ephemeral ports (32768 and up here) are refused ("expected i16"). The search starts
    at a random port (wrapping around), so launchers started together rarely pick the same ones.

    Raises:
        OSError: fewer than `count` free ports in `low`..32767.
    """
    start = random.randrange(low, 32768)
    found = []
    for port in itertools.chain(range(start, 32768), range(low, start)):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise OSError(f"fewer than {count} free ports in {low}..32767 for Dynamo's system servers")


def _answers(url: str) -> str:
    """The body `url` answers with status 200, "" otherwise."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError):
        return ""


def main(argv: list[str] | None = None) -> int:
    """Serve until Ctrl-C/SIGTERM. Returns the exit code (1: something failed to start or exited)."""
    parser = argparse.ArgumentParser(prog="scripts/serve_dynamo.sh", description="Dynamo frontend + N workers.")
    parser.add_argument("workers", type=int, nargs="?", default=2)
    parser.add_argument("--model", default=os.environ.get("OMNI_DYNAMO_MODEL")
                        or str(paths.models_dir() / "SmolLM2-135M-Instruct"))
    parser.add_argument("--router-mode", default=os.environ.get("OMNI_DYNAMO_ROUTER_MODE", "kv"),
                        choices=ROUTER_MODES)
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("OMNI_DYNAMO_HTTP_PORT", "9000")))
    parser.add_argument("--log-dir", help="where each process's log goes (default: <cache>/dynamo/logs/<time>-*)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.set())
    try:
        deployment = LocalDynamo(args.model, args.workers, args.router_mode, args.http_port, log_dir=args.log_dir,
                                 stop_event=stop)
    except ValueError as exc:
        print(f"[dynamo] {exc}", file=sys.stderr)
        return 1
    print(f"[dynamo] starting etcd, NATS, the frontend ({args.router_mode} routing) and {args.workers} workers; "
          f"logs in {deployment.log_dir}", flush=True)
    try:
        deployment.start()
        print(f"[dynamo] ready: OpenAI API at {deployment.base_url} (model {args.model!r}); worker health on ports "
              f"{', '.join(map(str, deployment.workers_health))}. Ctrl-C stops everything.", flush=True)
        while not stop.wait(1.0):
            name = deployment.exited()
            if name is not None:
                print(f"[dynamo] {name} exited; stopping. {deployment.tail(name)}", file=sys.stderr)
                return 1
        print(f"[dynamo] stopping (frontend first); logs kept in {deployment.log_dir}", flush=True)
        return 0
    except (FileNotFoundError, RuntimeError) as exc:
        print(f"[dynamo] {exc}", file=sys.stderr)
        return 1
    finally:
        deployment.stop()


if __name__ == "__main__":
    sys.exit(main())
