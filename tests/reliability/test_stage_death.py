"""Stage death (case c19): the llm stage's stub process is killed while requests are in flight (and a unary
stage's, preprocess: `test_killed_preprocess_stub_is_503_and_stays_down`).

What Triton 2.51 does by itself (seen here): nothing visible. `/v2/health/ready` and `/v2/models/llm/ready` stay
200, the streams the stub was serving are never ended, the stub is not restarted (python_backend has no restart
for decoupled models), and a new request to llm fails at once with "Stub process 'llm_0_0' is not healthy.". Or,
when the kill lands while the stub holds a shared-memory mutex, the whole server aborts
(`triton_aborted_on_the_stub_lock`); the front door's part below holds either way.

What the product adds (omni_backend/ops/metrics.py heartbeat, serving/metrics.py StageWatch): every stage
publishes a heartbeat gauge about once a second (llm from its metrics thread, which stops it when its loops
hang; the others from StageHeartbeat's thread); when one is older than STALE_AFTER_S the front door's /health and
the readiness probe (`python -m omni_backend.ops.ready`) say not ready, requests waiting on the llm stream end
with 503 (or an error event once streaming), and new requests get 503. The stage stays down (clearly unready)
until the server is restarted.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from email.message import Message

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException
from helpers.front_door import MODEL, FrontDoorThread, front_door_config

from omni_backend.ops.metrics import HEARTBEAT, STALE_AFTER_S, parse_metrics
from omni_backend.ops.ready import check, check_live

READY_WITHIN_S = 5.0  # readiness must turn false this soon after the stub dies
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
        "ignore_eos": True}


def stage_stub(server, model: str) -> psutil.Process:
    """`model`'s triton_python_backend_stub process (a child of tritonserver)."""
    stubs = [p for p in psutil.Process(server.process.pid).children(recursive=True)
             if _alive(p) and "triton_python_backend_stub" in " ".join(p.cmdline()[:1])
             and f"/{model}/" in " ".join(p.cmdline())]
    assert len(stubs) == 1, f"expected one {model} stub, found {[p.cmdline()[:2] for p in stubs]}"
    return stubs[0]


def llm_stub(server) -> psutil.Process:
    """The llm model's triton_python_backend_stub process (a child of tritonserver)."""
    return stage_stub(server, "llm")


def kill(stub: psutil.Process) -> float:
    """SIGKILL `stub` and wait until it is gone (or a zombie: tritonserver may not reap it).

    Returns:
        `time.monotonic()` when the signal was sent.
    """
    stub.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    while _alive(stub):
        assert time.monotonic() - killed < 10, "the stub outlived SIGKILL"
        time.sleep(0.05)
    return killed


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def http_answer(url: str, body: dict, timeout_s: float) -> tuple[int, Message, dict]:
    """POST `body`: (status, headers, JSON body); a read past `timeout_s` raises (a hang fails the test)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.headers, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read() or b"{}")


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


def heartbeat(server, model: str = "llm") -> float | None:
    """`model`'s last heartbeat (Unix s) on Triton's metrics page; None before its first publication."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    beats = [value for labels, value in parse_metrics(text).get(HEARTBEAT, []) if labels.get("model") == model]
    return beats[0] if beats and beats[0] else None


def wait_fresh_heartbeat(server, model: str) -> None:
    deadline = time.monotonic() + 10
    while not heartbeat(server, model) and time.monotonic() < deadline:  # 0 until the first publication
        time.sleep(0.2)
    assert abs(heartbeat(server, model) - time.time()) < STALE_AFTER_S, f"{model} publishes no fresh heartbeat"


def triton_aborted_on_the_stub_lock(server) -> bool:
    """Whether tritonserver itself died after the kill. Triton 2.51's python_backend aborts the whole server
    (`boost::interprocess::lock_exception`, then SIGABRT) when the stub dies holding one of their shared-memory
    mutexes, which a kill during a burst of streamed responses sometimes hits (2 runs of 12 here, AMD EPYC; upstream:
    triton-inference-server/server#8882, #5949). Any other exit fails the test with the log's tail."""
    try:
        server.process.wait(timeout=1)
    except subprocess.TimeoutExpired:
        return False
    log = server.log_file.read_text(errors="replace")
    assert "boost::interprocess::lock_exception" in log, f"tritonserver exited {server.process.returncode}:\n" \
                                                         f"{log[-3000:]}"
    return True


def wait_unready(server, door, killed: float) -> dict[str, float]:
    """Poll the front door's /health and the readiness probe until both say not ready: seconds after `killed`
    at which each flipped (the test fails if either is still ready READY_WITHIN_S + 1 s after the kill)."""
    flipped = {}
    while len(flipped) < 2 and time.monotonic() - killed < READY_WITHIN_S + 1:
        if "health" not in flipped and http_status(door.url + "/health")[0] == 503:
            flipped["health"] = time.monotonic() - killed
        if "probe" not in flipped and not check(server.http_url, server.metrics_url)[0]:
            flipped["probe"] = time.monotonic() - killed
        time.sleep(0.1)
    assert set(flipped) == {"health", "probe"}, f"still ready {READY_WITHIN_S + 1} s after the stub died"
    assert max(flipped.values()) < READY_WITHIN_S, flipped
    return flipped


def test_killed_llm_stub_turns_readiness_false_and_ends_requests(make_chat_server):
    server = make_chat_server()
    door = FrontDoorThread(front_door_config(server)).start()
    try:
        status, body = http_status(door.url + "/v1/chat/completions",
                                   {**LONG, "max_tokens": 8, "ignore_eos": False, "temperature": 0.0})
        assert status == 200 and body["choices"][0]["message"]["content"]
        wait_fresh_heartbeat(server, "llm")
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

        killed = kill(llm_stub(server))

        # readiness: the front door's /health and the k8s probe turn false within READY_WITHIN_S
        flipped = wait_unready(server, door, killed)
        aborted = triton_aborted_on_the_stub_lock(server)
        ready, reason = check(server.http_url, server.metrics_url)
        assert not ready and ("triton not ready" if aborted else "llm/1") in reason, reason

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
            assert errors and (aborted or "the llm stage stopped responding" in errors[-1]["message"]), seen[-3:]
            assert seen[-1] == "[DONE]"
        status, body = unary.get(timeout=40)
        assert status == 503, (status, body)
        ended_s = time.monotonic() - killed
        assert ended_s < 15, f"in-flight requests took {ended_s:.1f} s to end"
        if aborted:  # no Triton left to ask: the front door refuses new work, the deployment's probes restart it
            status, body = http_status(door.url + "/v1/chat/completions", {**LONG, "max_tokens": 4}, 30.0)
            assert status == 503, (status, body)
            assert http_status(door.url + "/health")[0] == 503
            print(f"tritonserver aborted on the dead stub's lock; readiness false after {flipped}, in-flight "
                  f"requests ended {ended_s:.1f} s after the kill")
            return

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


def test_killed_preprocess_stub_is_503_and_stays_down(make_chat_server):
    """A unary (non-decoupled) stage's stub dies. Measured on this Triton 2.51 (PyTriton 0.7.0's build, whose
    python_backend has no restart code: no "will be restarted" in libtriton_python.so): the stub is not restarted,
    and every request to the stage fails after about 1 s (python_backend's health-mutex timeout) with gRPC
    INTERNAL "Stub process 'preprocess_0_0' is not healthy.", and Triton keeps the model READY. Its heartbeat
    (ops/metrics.py StageHeartbeat) stops with the process, so the front door's /health and the readiness probe
    turn false within READY_WITHIN_S before any request meets the dead stage. The front door answers each
    request 503 + Retry-After, never 500 and never a hang."""
    server = make_chat_server()
    door = FrontDoorThread(front_door_config(server)).start()
    chat = door.url + "/v1/chat/completions"
    short = {**LONG, "max_tokens": 4, "ignore_eos": False, "temperature": 0.0}
    try:
        status, _, body = http_answer(chat, short, 60.0)
        assert status == 200 and body["choices"][0]["message"]["content"], body
        wait_fresh_heartbeat(server, "preprocess")
        assert check(server.http_url, server.metrics_url) == (True, "ok")
        killed = kill(stage_stub(server, "preprocess"))
        flipped = wait_unready(server, door, killed)  # no request has met the dead stage yet
        ready, reason = check(server.http_url, server.metrics_url)
        assert not ready and "preprocess/1" in reason, reason

        answers = []  # (status, seconds) of each front-door request after the kill
        for _ in range(5):
            started = time.monotonic()
            status, headers, body = http_answer(chat, short, 30.0)  # a hang raises
            answers.append((status, round(time.monotonic() - started, 2)))
            assert status == 503, (answers, body)  # never a 500: a dead stage is unavailable, not a bug
            assert headers.get("Retry-After") == "1", dict(headers)
            message = body["error"]["message"]
            assert message.startswith("the preprocess stage is down") and "not healthy" in message, message
            assert time.monotonic() - started < 5, answers
            time.sleep(0.5)

        # what Triton itself answers a unary call to the dead stage (what the front door maps)
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            text = grpcclient.InferInput("text_input", [1], "BYTES")
            text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
            limit = grpcclient.InferInput("max_tokens", [1], "INT32")
            limit.set_data_from_numpy(np.array([4], dtype=np.int32))
            with pytest.raises(InferenceServerException) as excinfo:
                client.infer("preprocess", [text, limit], client_timeout=30)
            model_ready = client.is_model_ready("preprocess")
        raised = excinfo.value
        print(f"readiness false after {flipped}; front door after the preprocess stub was killed: {answers}; "
              f"Triton: {raised.status()} "
              f"{raised.message()!r}, preprocess ready {model_ready}; /health {http_status(door.url + '/health')}; "
              f"probe {check(server.http_url, server.metrics_url)}")
        assert raised.status() == "StatusCode.INTERNAL"
        assert "Stub process 'preprocess_0_0' is not healthy" in raised.message()
        # the stage stays clearly down: /health and the probe stay unready, liveness fails (Triton's stays 200)
        status, body = http_status(door.url + "/health")
        assert status == 503 and "preprocess" in body["error"]["message"], body
        assert not check(server.http_url, server.metrics_url)[0]
        live, reason = check_live(server.http_url, server.metrics_url)
        assert not live and "preprocess/1 silent for" in reason, reason
        assert http_status(f"http://{server.http_url}/v2/health/live")[0] == 200
        # no restart: no preprocess stub process comes back
        stubs = [p for p in psutil.Process(server.process.pid).children(recursive=True)
                 if _alive(p) and "/preprocess/" in " ".join(p.cmdline())]
        assert not stubs, [p.pid for p in stubs]
    finally:
        door.stop()
