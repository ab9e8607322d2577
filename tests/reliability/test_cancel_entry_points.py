"""Case c35: a client that cancels a stream, through any entry point, stops its generation.

Every way in: a gRPC stream to each streaming entry point (`omni_chat`, `omni_chat_mm` with an image,
`omni_speech`) cancelled with `stop_stream(cancel_requests=True)`; an HTTP `generate_stream` closed after its first
events, on Triton's own port and through the front door's `/v2`; and a front door `/v1` stream closed. Each asks for
MAX_TOKENS with `ignore_eos` (minutes of generation on this CPU); after the cancel, the llm stage's
`omni_requests_running` / `_waiting` must be back to 0 and its KV blocks to the idle level within IDLE_WITHIN_S
(the gauges are published about once a second), and an ordinary request through the same entry point (and the
front door's greedy one, `followed_by_a_normal_request`) must still work. Last, a server of its own with a 30 s exit
timeout exits at once after such cancels: no orphan generation holds it.
"""

from __future__ import annotations

import io
import json
import queue
import socket
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from helpers.chat_client import chat_messages, http_generate, make_inputs, stream_inputs
from helpers.llm_metrics import llm_metrics, wait_for
from helpers.media_inputs import image_part

pytestmark = pytest.mark.usefixtures("followed_by_a_normal_request")

MAX_TOKENS = 1500
IDLE_WITHIN_S = 2.0
PROMPT = "Tell me a long story about a dragon who learns to paint."
LONG = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, "temperature": 0.0}


def small_png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buffer, "PNG")
    return buffer.getvalue()


def idle(metrics_url: str):
    gauges = llm_metrics(metrics_url)
    done = gauges["omni_requests_running"] == 0 and gauges["omni_requests_waiting"] == 0
    return gauges if done else None


def generating(metrics_url: str) -> bool:
    return llm_metrics(metrics_url)["omni_requests_running"] >= 1


@pytest.fixture
def idle_kv(triton_server) -> float:
    """The llm stage's KV blocks in use while idle, read before the case (0 on the session server)."""
    before = wait_for(lambda: idle(triton_server.metrics_url), 15)
    assert before, f"the llm stage is not idle before the case: {llm_metrics(triton_server.metrics_url)}"
    return before["omni_kv_cache_blocks_used"]


def assert_back_to_idle(metrics_url: str, idle_kv: float, cancelled_at: float) -> float:
    """Wait until the llm stage runs nothing and holds only the idle level of KV blocks; returns the seconds since
    `cancelled_at` (time.monotonic()), which must be under IDLE_WITHIN_S."""
    back = wait_for(lambda: (g := idle(metrics_url)) and g["omni_kv_cache_blocks_used"] == idle_kv, 10, 0.05)
    took = time.monotonic() - cancelled_at
    assert back, f"the llm stage still generates 10 s after the cancel: {llm_metrics(metrics_url)}"
    assert took < IDLE_WITHIN_S, f"the llm stage went idle {took:.1f} s after the cancel"
    return took


def entry_inputs(model: str, values: dict) -> list:
    """tritonclient inputs of a request to `model` (omni_speech: with the default voice)."""
    inputs = make_inputs(values, grpcclient)
    if model == "omni_speech":
        voice = grpcclient.InferInput("voice", [1], "BYTES")
        voice.set_data_from_numpy(np.array([b"joe"], dtype=np.object_))
        inputs.append(voice)
    return inputs


def cancel_grpc_stream(grpc_url: str, metrics_url: str, model: str, values: dict, after: int) -> float:
    """Stream one request to `model`, cancel it after `after` responses (once the llm stage shows it running);
    returns when it was cancelled (time.monotonic())."""
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        client.async_stream_infer(model, entry_inputs(model, values))
        for _ in range(after):
            result, error = events.get(timeout=120)
            assert error is None, error
            assert not result.get_response().parameters["triton_final_response"].bool_param
        assert wait_for(lambda: generating(metrics_url), 5), "the llm stage does not show the request running"
        cancelled_at = time.monotonic()
        client.stop_stream(cancel_requests=True)
        return cancelled_at
    finally:
        client.close()


def close_http_stream(port: int, metrics_url: str, path: str, body: dict, events: int) -> float:
    """POST a streamed request over a raw socket, read `events` server-sent events, close the socket once the llm
    stage shows it running; returns when it was closed (time.monotonic())."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    try:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        received = b""
        while received.count(b"data: ") < events:
            chunk = sock.recv(65536)
            assert chunk, f"the stream ended before {events} events: {received[-500:]!r}"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200"), received[:300]
        assert wait_for(lambda: generating(metrics_url), 5), "the llm stage does not show the request running"
        return time.monotonic()
    finally:
        sock.close()


@pytest.mark.parametrize("model", ["omni_chat", "omni_chat_mm", "omni_speech"])
def test_grpc_stream_cancelled_stops_the_generation(triton_server, idle_kv, model):
    values = {"text_input": chat_messages(PROMPT), **LONG}
    after = 16
    if model == "omni_chat_mm":
        values["text_input"] = json.dumps([{"role": "user", "content": [{"type": "text", "text": PROMPT},
                                                                         image_part(small_png())]}])
    if model == "omni_speech":
        after = 1  # a response is a spoken phrase
    cancelled_at = cancel_grpc_stream(triton_server.grpc_url, triton_server.metrics_url, model, values, after)
    took = assert_back_to_idle(triton_server.metrics_url, idle_kv, cancelled_at)
    print(f"{model}: idle {took:.2f} s after the cancel")

    ordinary = {"text_input": chat_messages("What is the capital of France?"), "max_tokens": 8, "temperature": 0.0}
    result = stream_inputs(triton_server.grpc_url, entry_inputs(model, ordinary), model)
    assert result.error is None and "Paris" in result.text, (result.error, result.text)


@pytest.mark.parametrize("through", ["triton", "front_door_v2"])
def test_http_generate_stream_closed_stops_the_generation(triton_server, front_door, idle_kv, through):
    port = triton_server.http_port if through == "triton" else front_door.config.port
    cancelled_at = close_http_stream(port, triton_server.metrics_url, "/v2/models/omni_chat/generate_stream",
                                     {"text_input": chat_messages(PROMPT), **LONG}, events=4)
    took = assert_back_to_idle(triton_server.metrics_url, idle_kv, cancelled_at)
    print(f"generate_stream through {through}: idle {took:.2f} s after closing")

    url = triton_server.http_url if through == "triton" else f"127.0.0.1:{front_door.config.port}"
    status, body = http_generate(url, {"text_input": chat_messages("What is the capital of France?"),
                                       "max_tokens": 8, "temperature": 0.0})
    assert status == 200 and "Paris" in body["text_output"], body


def test_v1_stream_closed_stops_the_generation(triton_server, front_door, idle_kv):
    body = {"model": "omni_chat", "messages": [{"role": "user", "content": PROMPT}], "stream": True,
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}
    cancelled_at = close_http_stream(front_door.config.port, triton_server.metrics_url, "/v1/chat/completions", body,
                                     events=4)
    took = assert_back_to_idle(triton_server.metrics_url, idle_kv, cancelled_at)
    print(f"/v1 stream: idle {took:.2f} s after closing")


def test_shutdown_does_not_wait_for_cancelled_streams(make_chat_server):
    """With a 30 s exit timeout, a server whose clients cancelled their streams exits at once: no orphan
    generation is left for tritonserver to wait on (nor for the llm stage to abort at the exit timeout)."""
    server = make_chat_server(exit_timeout_s=30)
    assert wait_for(lambda: idle(server.metrics_url), 15)
    cancel_grpc_stream(server.grpc_url, server.metrics_url, "omni_chat", {"text_input": chat_messages(PROMPT),
                                                                          **LONG}, after=4)
    closed_at = close_http_stream(server.http_port, server.metrics_url, "/v2/models/omni_chat/generate_stream",
                                  {"text_input": chat_messages(PROMPT), **LONG}, events=4)
    assert_back_to_idle(server.metrics_url, 0, closed_at)
    began = time.monotonic()
    code = server.stop()
    took = time.monotonic() - began
    assert code == 0, server.log_text()[-3000:]
    assert took < 10, f"tritonserver took {took:.1f} s to exit after its clients cancelled"
    print(f"exited {took:.1f} s after SIGTERM")
