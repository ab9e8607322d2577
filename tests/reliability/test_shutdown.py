"""Graceful shutdown: SIGTERM lets requests in flight finish and refuses new ones.

tritonserver 2.51 (seen on this binary): on SIGTERM it stops every model for new requests at once (a new request
to any model fails with NOT_FOUND "Request for unknown model: '<m>' has no available versions", server readiness
is UNAVAILABLE "Server exiting"), keeps a model loaded while requests it accepted are still streaming (the llm
stage's running and waiting requests alike), unloads it when they are done, and exits with code 0, all within
`--exit-timeout-secs`. Requests that would outlast the exit timeout are aborted by the llm stage 3 s before it
ends (finish reason "abort"), so the server still exits 0 (left alone, 2.51 crashes in its teardown and hangs).
The front door (its own process, `python -m omni_backend.serving`) closes its listening socket at once (new
connections are refused) and lets streams in flight run for up to `graceful_shutdown_s`.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.grpc as grpcclient
from helpers.chat_client import make_inputs
from helpers.front_door import MODEL, FrontDoorThread, front_door_config
from helpers.llm_stream import LLMStream, llm_inputs
from tritonclient.utils import InferenceServerException

from omni_backend.launch.front_door import FrontDoorProcess
from omni_backend.stages.llm.stop_watch import STOP_POLL_INTERVAL_S

PROMPT = "Tell me a story about a dragon."
MAX_TOKENS = 48  # about 3 s of float32 decode steps at batch 2: the running ones end well after SIGTERM + 0.5 s
EXIT_TIMEOUT_S = 20


def chat_body(stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": stream}


def post(url: str, body: dict, timeout_s: float = 60.0):
    """POST JSON; returns (status, headers, parsed body)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read())


def test_sigterm_to_tritonserver_finishes_running_and_waiting_requests_and_refuses_new_ones(make_chat_server):
    # 2 sequences run at once: of 4 requests in flight, 2 are still waiting in the llm stage's queue at SIGTERM
    server = make_chat_server(exit_timeout_s=EXIT_TIMEOUT_S, max_num_seqs=2, max_queued_requests=4)
    alone = LLMStream(server.grpc_url)
    alone.send(llm_inputs(server.grpc_url, PROMPT, MAX_TOKENS))
    reference = alone.collect()
    assert reference["error"] is None and (reference["tokens"], reference["finish_reason"]) == (MAX_TOKENS, "length")
    door = FrontDoorThread(front_door_config(server)).start()
    try:
        with urllib.request.urlopen(door.url + "/v1/models", timeout=30) as response:  # it reads the wiring now
            assert json.loads(response.read())["data"][0]["id"] == MODEL
        late_inputs = llm_inputs(server.grpc_url, PROMPT, MAX_TOKENS)  # for a request sent after SIGTERM
        streams = [LLMStream(server.grpc_url) for _ in range(4)]
        for stream in streams:
            stream.send(llm_inputs(server.grpc_url, PROMPT, MAX_TOKENS))
        deadline = time.monotonic() + 60
        while streams[0].events.empty() and time.monotonic() < deadline:  # generation has started
            time.sleep(0.01)
        assert not streams[0].events.empty()
        with ThreadPoolExecutor(len(streams)) as pool:
            results = [pool.submit(stream.collect) for stream in streams]
            sigterm_at = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            time.sleep(0.5)

            # new requests are refused at once, by every model and by the front door
            late = LLMStream(server.grpc_url)
            late.send(late_inputs)
            refused = late.collect(timeout_s=10)
            assert refused["error"] == "Request for unknown model: 'llm' has no available versions"
            assert refused["ended_after_s"] < 1.0
            client = grpcclient.InferenceServerClient(server.grpc_url)
            try:
                with pytest.raises(InferenceServerException) as unary:
                    client.infer("preprocess", make_inputs({"text_input": PROMPT, "max_tokens": 4}, grpcclient))
                assert (unary.value.status(), unary.value.message()) == (
                    "StatusCode.NOT_FOUND", "Request for unknown model: 'preprocess' has no available versions")
                with pytest.raises(InferenceServerException) as ready:
                    client.is_server_ready()
                assert (ready.value.status(), ready.value.message()) == ("StatusCode.UNAVAILABLE", "Server exiting")
            finally:
                client.close()
            status, headers, body = post(door.url + "/v1/chat/completions", chat_body(stream=False))
            assert (status, headers["Retry-After"], body["error"]["code"]) == (503, "1", "service_unavailable")
            assert body["error"]["message"] == ("a pipeline model is not loaded: Request for unknown model: "
                                                "'preprocess' has no available versions")

            # ... while the 4 accepted ones (2 running, 2 waiting at SIGTERM) run to their end
            for stream, future in zip(streams, results):
                result = future.result()
                assert result["error"] is None
                assert stream.sent_at + result["ended_after_s"] > sigterm_at + 0.5  # in flight at SIGTERM
                assert (result["text"], result["tokens"], result["finish_reason"]) == (
                    reference["text"], MAX_TOKENS, "length")
        code = server.process.wait(EXIT_TIMEOUT_S + 10)
        exited_after_s = time.monotonic() - sigterm_at
        assert code == 0
        assert exited_after_s < EXIT_TIMEOUT_S, f"exited {exited_after_s:.1f} s after SIGTERM"
        log = server.log_text()
        assert "Exit timeout expired" not in log and "shutting down" not in log
        # the stubs' metric families are released in finalize (triton_glue.release_python_objects), not by the
        # interpreter's exit, where 2.51's stub segfaults on them
        assert "Segfault encountered" not in log
    finally:
        door.stop()


def read_stream(response, events: list, first_delta: threading.Event) -> None:
    """Read an SSE chat stream into `events` (parsed JSON or "[DONE]"), setting `first_delta` at the first text."""
    for raw in response:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data: "):
            data = line[len("data: "):]
            event = data if data == "[DONE]" else json.loads(data)
            events.append((time.monotonic(), event))
            if event != "[DONE]" and any(c["delta"].get("content") for c in event.get("choices", [])):
                first_delta.set()


def test_sigterm_to_the_front_door_process_lets_streams_finish_and_refuses_new_connections(make_chat_server):
    server = make_chat_server(exit_timeout_s=EXIT_TIMEOUT_S)
    grace_s = 20
    door = FrontDoorProcess(front_door_config(server, host="127.0.0.1", graceful_shutdown_s=grace_s)).start()
    url = f"http://127.0.0.1:{door.config.port}/v1/chat/completions"
    try:
        status, _, reference = post(url, chat_body(stream=False))
        assert status == 200 and reference["usage"]["completion_tokens"] == MAX_TOKENS
        expected = reference["choices"][0]["message"]["content"]
        readers, all_events = [], []
        for _ in range(3):
            request = urllib.request.Request(url, data=json.dumps(chat_body(stream=True)).encode(),
                                             headers={"Content-Type": "application/json"}, method="POST")
            response = urllib.request.urlopen(request, timeout=60)
            events, first_delta = [], threading.Event()
            reader = threading.Thread(target=read_stream, args=(response, events, first_delta), daemon=True)
            reader.start()
            readers.append((reader, first_delta))
            all_events.append(events)
        for _, first_delta in readers:
            assert first_delta.wait(60)
        sigterm_at = time.monotonic()
        door.process.send_signal(signal.SIGTERM)

        refused_at = None  # new connections are refused once uvicorn has closed its socket
        while refused_at is None and time.monotonic() < sigterm_at + 5:
            try:
                socket.create_connection(("127.0.0.1", door.config.port), timeout=1).close()
                time.sleep(0.05)
            except ConnectionRefusedError:
                refused_at = time.monotonic()
        assert refused_at is not None and refused_at - sigterm_at < 2.0

        for (reader, _), events in zip(readers, all_events):
            reader.join(grace_s + 10)
            assert not reader.is_alive()
            assert events[-1][1] == "[DONE]" and events[-1][0] > sigterm_at  # it streamed on after SIGTERM
            chunks = [event for _, event in events[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            assert (text, chunks[-1]["choices"][0]["finish_reason"]) == (expected, "length")
        code = door.process.wait(grace_s + 10)
        exited_after_s = time.monotonic() - sigterm_at
        # uvicorn re-raises the signal it caught once it has shut down: the process ends by SIGTERM
        assert code == -signal.SIGTERM
        assert exited_after_s < grace_s
    finally:
        door.stop()


def test_requests_still_running_at_the_exit_timeout_are_aborted_and_the_server_exits_cleanly(make_chat_server):
    # tritonserver 2.51 crashes (signal 11/6 in its teardown) and hangs with the clients' streams open when its exit
    # timeout runs out with a decoupled request in flight; the llm stage aborts them 3 s before (STOP_MARGIN_S)
    exit_timeout_s = 8
    server = make_chat_server(exit_timeout_s=exit_timeout_s)
    long_tokens = 600  # about 40 s of float32 decode steps here: far longer than the exit timeout
    streams = [LLMStream(server.grpc_url) for _ in range(2)]
    for stream in streams:
        stream.send(llm_inputs(server.grpc_url, PROMPT, long_tokens))
    deadline = time.monotonic() + 60
    while any(stream.events.empty() for stream in streams) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(stream.events.empty() for stream in streams)
    # the stage's watch looks every STOP_POLL_INTERVAL_S and acts only once it has seen the server serving: a
    # first token can come sooner than its first look after start
    time.sleep(2 * STOP_POLL_INTERVAL_S)
    sigterm_at = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    with ThreadPoolExecutor(len(streams)) as pool:
        results = list(pool.map(lambda stream: stream.collect(timeout_s=exit_timeout_s + 10), streams))
    for stream, result in zip(streams, results):
        assert result["error"] is None and result["finish_reason"] == "abort"
        assert 0 < result["tokens"] < long_tokens and result["text"]
        ended_after_sigterm_s = stream.sent_at + result["ended_after_s"] - sigterm_at
        assert exit_timeout_s - 3 <= ended_after_sigterm_s < exit_timeout_s
    code = server.process.wait(exit_timeout_s + 10)
    assert code == 0 and time.monotonic() - sigterm_at < exit_timeout_s + 1
    log = server.log_text()
    assert "Exit timeout expired" not in log and "Signal (11)" not in log and "Signal (6)" not in log
    assert "Segfault encountered" not in log
    assert "aborted 2 requests still running at the server's exit timeout" in log
