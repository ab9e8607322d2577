"""Stage death (case c19): the llm stage's stub process is killed while requests are in flight.

What Triton 2.51 does by itself (seen here): nothing visible. `/v2/health/ready` and `/v2/models/llm/ready` stay
200, the streams the stub was serving are never ended, the stub is not restarted (python_backend has no restart
for decoupled models), and a new request to llm fails at once with "Stub process 'llm_0_0' is not healthy.".

What the product adds (omni_backend/ops/metrics.py heartbeat, serving/metrics.py StageWatch): the llm stage
publishes a heartbeat gauge about once a second; when it is older than STALE_AFTER_S the front door's /health and
the readiness probe (`python -m omni_backend.ops.ready`) say not ready, requests waiting on the llm stream end
with 503 (or an error event once streaming), and new requests get 503. The stage stays down (clearly unready)
until the server is restarted.
"""

from __future__ import annotations

import json
import queue
import signal
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import psutil
import tritonclient.grpc as grpcclient
from front_door import MODEL, FrontDoorThread, front_door_config

from omni_backend.ops.metrics import HEARTBEAT, STALE_AFTER_S, parse_metrics
from omni_backend.ops.ready import check, check_live

READY_WITHIN_S = 5.0  # readiness must turn false this soon after the stub dies
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
        "ignore_eos": True}


def llm_stub(server) -> psutil.Process:
    """The llm model's triton_python_backend_stub process (a child of tritonserver)."""
    stubs = [p for p in psutil.Process(server.process.pid).children(recursive=True)
             if "triton_python_backend_stub" in " ".join(p.cmdline()[:1]) and "/llm/" in " ".join(p.cmdline())]
    assert len(stubs) == 1, f"expected one llm stub, found {[p.cmdline()[:2] for p in stubs]}"
    return stubs[0]


def http_status(url: str, body: dict | None = None, timeout_s: float = 10.0) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"},
                                     method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def stream_chat(url: str, events: queue.Queue, timeout_s: float) -> None:
    """A streamed chat request; puts ("status", code), then ("event", data) per SSE event, then ("end", None)
    or ("exception", repr). Every read is bounded by `timeout_s`."""
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps({**LONG, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            events.put(("status", response.status))
            for line in response:
                if line.startswith(b"data: "):
                    events.put(("event", line[6:].strip().decode()))
        events.put(("end", None))
    except urllib.error.HTTPError as exc:
        events.put(("status", exc.code))
        events.put(("end", None))
    except Exception as exc:  # noqa: BLE001 - a timeout is what the test reports
        events.put(("exception", repr(exc)))


def heartbeat(server) -> float | None:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    samples = parse_metrics(text).get(HEARTBEAT, [])
    return samples[0][1] if samples else None


def test_killed_llm_stub_turns_readiness_false_and_ends_requests(make_chat_server):
    server = make_chat_server()
    door = FrontDoorThread(front_door_config(server)).start()
    try:
        status, body = http_status(door.url + "/v1/chat/completions",
                                   {**LONG, "max_tokens": 8, "ignore_eos": False, "temperature": 0.0})
        assert status == 200 and body["choices"][0]["message"]["content"]
        deadline = time.monotonic() + 10
        while not heartbeat(server) and time.monotonic() < deadline:  # 0 until the first publication
            time.sleep(0.2)
        assert abs(heartbeat(server) - time.time()) < STALE_AFTER_S, "the llm stage publishes no fresh heartbeat"
        assert http_status(door.url + "/health")[0] == 200
        assert check(server.http_url, server.metrics_url) == (True, "ok")
        assert check_live(server.http_url, server.metrics_url) == (True, "ok")

        # in flight: two streamed chats (one is past its first chunk), one non-streamed chat
        streams = [queue.Queue() for _ in range(2)]
        for events in streams:
            threading.Thread(target=stream_chat, args=(door.url, events, 30.0), daemon=True).start()
        unary: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: unary.put(http_status(door.url + "/v1/chat/completions", LONG, 30.0)),
                         daemon=True).start()
        for events in streams:
            assert events.get(timeout=60) == ("status", 200)
            kind, data = events.get(timeout=30)
            assert kind == "event" and "error" not in json.loads(data)

        stub = llm_stub(server)
        stub.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while stub.is_running() and stub.status() != psutil.STATUS_ZOMBIE:  # tritonserver may not reap it
            assert time.monotonic() - killed < 10, "the llm stub outlived SIGKILL"
            time.sleep(0.05)

        # readiness: the front door's /health and the k8s probe turn false within READY_WITHIN_S
        flipped = {}
        while len(flipped) < 2 and time.monotonic() - killed < READY_WITHIN_S + 1:
            if "health" not in flipped and http_status(door.url + "/health")[0] == 503:
                flipped["health"] = time.monotonic() - killed
            if "probe" not in flipped and not check(server.http_url, server.metrics_url)[0]:
                flipped["probe"] = time.monotonic() - killed
            time.sleep(0.1)
        assert set(flipped) == {"health", "probe"}, f"still ready {READY_WITHIN_S + 1} s after the stub died"
        assert max(flipped.values()) < READY_WITHIN_S, flipped
        ready, reason = check(server.http_url, server.metrics_url)
        assert not ready and "llm/1" in reason, reason

        # in-flight requests end with an error, none hangs
        for events in streams:
            seen = []
            while True:
                kind, data = events.get(timeout=30)  # the reads are bounded by 30 s themselves
                assert kind != "exception", f"a streamed request hung or broke instead of ending: {data}"
                if kind == "end":
                    break
                seen.append(data)
            errors = [json.loads(d)["error"] for d in seen if d != "[DONE]" and "error" in json.loads(d)]
            assert errors and "the llm stage stopped responding" in errors[-1]["message"], seen[-3:]
            assert seen[-1] == "[DONE]"
        status, body = unary.get(timeout=40)
        assert status == 503, (status, body)
        ended_s = time.monotonic() - killed
        assert ended_s < 15, f"in-flight requests took {ended_s:.1f} s to end"

        # a new request fails fast: through the front door (503) and straight to llm (Triton's own error)
        started = time.monotonic()
        status, body = http_status(door.url + "/v1/chat/completions", {**LONG, "max_tokens": 4}, 30.0)
        assert status == 503 and "llm" in body["error"]["message"], (status, body)
        assert time.monotonic() - started < 5
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            done: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: done.put(error))
            ids = grpcclient.InferInput("input_ids", [3], "INT32")
            ids.set_data_from_numpy(np.array([1, 2, 3], dtype=np.int32))
            params = grpcclient.InferInput("sampling_params", [1], "BYTES")
            params.set_data_from_numpy(np.array([b'{"max_tokens": 2}'], dtype=np.object_))
            client.async_stream_infer("llm", [ids, params])
            error = done.get(timeout=10)
            client.stop_stream(cancel_requests=True)
        assert error is not None and "not healthy" in str(error)

        # the stage stays clearly down: no restart in Triton 2.51, readiness stays false, and the liveness check
        # (a deployment's liveness probe, which restarts the server) fails while Triton's own stays 200
        time.sleep(2)
        assert http_status(door.url + "/health")[0] == 503
        assert not check(server.http_url, server.metrics_url)[0]
        live, reason = check_live(server.http_url, server.metrics_url)
        assert not live and "llm/1 silent for" in reason, reason
        assert http_status(f"http://{server.http_url}/v2/health/live")[0] == 200
        assert server.process.poll() is None
        print(f"readiness false after {flipped}; in-flight requests ended {ended_s:.1f} s after the kill")
    finally:
        door.stop()
