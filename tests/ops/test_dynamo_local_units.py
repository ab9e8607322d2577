"""The local Dynamo launcher (launch/dynamo/local.py, launch/dynamo/control_plane.py) without Dynamo, etcd or NATS:
fake processes and binaries, a local HTTP server and socket standing in for etcd and NATS."""

from __future__ import annotations

import http.server
import socket
import sys
import threading
from pathlib import Path

import pytest

from omni_backend.launch.dynamo import control_plane, local
from omni_backend.launch.dynamo.local import LocalDynamo, worker_devices
from omni_backend.ops.torch_flavor import Driver


@pytest.fixture(autouse=True)
def no_gpu_no_kv_events(monkeypatch, tmp_path):
    monkeypatch.setattr(local, "nvidia_driver", lambda: None)
    monkeypatch.delenv("OMNI_KV_EVENTS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path / "cache"))


def test_each_worker_gets_a_gpu_of_its_own_and_more_workers_than_gpus_are_refused():
    assert worker_devices(2, gpus=2, visible=None) == ["0", "1"]
    assert worker_devices(2, gpus=8, visible="5, 3") == ["5", "3"]
    assert worker_devices(3, gpus=0, visible=None) == [None, None, None]  # CPU: the environment stays as it is
    assert worker_devices(2, gpus=2, visible="") == [None, None]  # no GPU visible to this process
    with pytest.raises(ValueError, match="3 workers need a GPU each, but 2 GPU"):
        worker_devices(3, gpus=2, visible=None)


def test_the_workers_start_on_their_gpus_after_etcd_and_nats_answer(monkeypatch, tmp_path):
    monkeypatch.setattr(local, "nvidia_driver", lambda: Driver(gpus=2, cuda=(12, 8)))
    monkeypatch.setattr(local, "find_binary", lambda name: f"/bin/{name}")
    frontend = tmp_path / "python"
    frontend.touch()
    monkeypatch.setattr(local, "frontend_python", lambda: frontend)
    events = []
    monkeypatch.setattr(local, "wait_etcd_and_nats", lambda *args: events.append("control plane ready"))
    deployment = LocalDynamo("/models/m", workers=2)
    monkeypatch.setattr(deployment, "_spawn", lambda name, command, env=None: events.append(
        (name, (env or {}).get("CUDA_VISIBLE_DEVICES"))))
    monkeypatch.setattr(deployment, "_wait_ready", lambda timeout_s: None)
    deployment._start(1.0)
    assert events == [("etcd", None), ("nats", None), "control plane ready", ("frontend", None),
                      ("worker0", "0"), ("worker1", "1")]
    with pytest.raises(ValueError, match="3 workers need a GPU each"):
        LocalDynamo("/models/m", workers=3)


def test_one_kv_events_endpoint_for_several_workers_is_refused(monkeypatch):
    monkeypatch.setenv("OMNI_KV_EVENTS", "tcp://*:5557")
    with pytest.raises(ValueError, match="each of the 2 workers binds its own stream"):
        LocalDynamo("/models/m", workers=2)
    with pytest.raises(ValueError, match="each of the 2 workers"):
        LocalDynamo("/models/m", workers=2, settings={"kv_events": "ipc:///tmp/x"})
    LocalDynamo("/models/m", workers=1)  # one worker binds it alone


def test_a_process_that_exits_is_reported_with_its_log_tail_and_the_log_is_kept(tmp_path):
    deployment = LocalDynamo("/models/m", workers=1)
    assert Path(deployment.log_dir).parent == tmp_path / "cache" / "dynamo" / "logs"
    process = deployment._spawn("worker0", [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"])
    process.wait()
    with pytest.raises(RuntimeError, match=r"worker0 exited with code 3; .*worker0\.log ends with:\nno such model"):
        deployment._check_alive()
    deployment.stop()
    assert deployment.log("worker0") == "no such model\n"


def test_startup_ends_when_the_stop_event_is_set():
    deployment = LocalDynamo("/models/m", workers=1)
    deployment.workers_health = [1]  # nothing answers there
    deployment.stop_event.set()  # as main's SIGINT/SIGTERM handler does
    with pytest.raises(RuntimeError, match="stopped before the deployment was ready"):
        deployment._wait_ready(600)


class _Process:
    def __init__(self, name, stopped):
        self.name, self.stopped = name, stopped

    def poll(self):
        return None

    def send_signal(self, signum):
        self.stopped.append(self.name)

    def wait(self, timeout=None):
        return 0


def test_stop_ends_the_frontend_first_then_the_workers_then_nats_and_etcd():
    deployment = LocalDynamo("/models/m", workers=2)
    stopped = []
    deployment._processes = [(name, _Process(name, stopped)) for name in ("etcd", "nats", "frontend", "worker0",
                                                                          "worker1")]
    deployment.stop()
    assert stopped == ["frontend", "worker1", "worker0", "nats", "etcd"]


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_control_plane_wait_returns_once_etcd_health_and_the_nats_port_answer_and_stops_on_request():
    etcd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=etcd.serve_forever, daemon=True).start()
    nats = socket.create_server(("127.0.0.1", 0))
    try:
        control_plane.wait_etcd_and_nats(etcd.server_address[1], nats.getsockname()[1], 10, lambda: None)
        stop = threading.Event()
        stop.set()
        with pytest.raises(RuntimeError, match="stopped while waiting for etcd and NATS"):
            control_plane.wait_etcd_and_nats(etcd.server_address[1], 1, 600, lambda: None, stop)
        with pytest.raises(RuntimeError, match="^NATS not answering within 0 s$"):
            control_plane.wait_etcd_and_nats(etcd.server_address[1], 1, 0, lambda: None)
    finally:
        etcd.shutdown()
        nats.close()


def test_system_ports_start_at_a_random_port_and_wrap_around_below_32768(monkeypatch):
    monkeypatch.setattr(local.random, "randrange", lambda low, high: high - 1)
    assert local.system_ports(2, low=32766) == [32767, 32766]  # from the start up to 32767, then from `low`
    with pytest.raises(OSError, match="fewer than 3 free ports in 32766..32767"):
        local.system_ports(3, low=32766)
