"""Cancel storm: 200 streamed requests cancelled at random points leave nothing behind.

Half are gRPC streams cancelled with `stop_stream(cancel_requests=True)` after a random number of responses (0:
right after sending), alternately straight to the decoupled `llm` model and to the `omni_chat` entry point (which
must end the llm generation it started: omni_backend/stages/entry_points.py). Half go through the OpenAI front door
and drop their TCP connection at a random point: before the request body is complete, right after sending it
(before the first byte of the answer), after the status line, or after some SSE events. A few of each run to the
end. At most `CONCURRENCY` are in flight at once, in a seeded random order.

Afterwards, within a few seconds: the llm stage's KV blocks in use and its running/waiting requests are back at
their starting values (omni_* gauges on Triton's metrics port, published about once a second), the front door
holds no generation, the server process is alive, and a greedy request gives exactly the text it gave before.
Then 500 more streams (llm and omni_chat alike) cancelled after their first response must not grow tritonserver's
RSS by 5 MiB or more.
"""

from __future__ import annotations

import json
import queue
import random
import re
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import psutil
import tritonclient.grpc as grpcclient
from helpers.chat_client import make_inputs
from helpers.llm_metrics import llm_metrics, wait_for
from helpers.front_door import MODEL, FrontDoorThread, front_door_config

SEED = 8
REQUESTS = 200
CONCURRENCY = 24
MAX_TOKENS = 12  # ignore_eos: every request could run this long; most are cancelled before
PROMPTS = ["Tell me a story about a dragon.", "Why is the sky blue?", "Count to twenty.",
           "Write a poem about the sea.", "What is the capital of France?"]
GREEDY = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
          "max_tokens": 16, "temperature": 0.0}
WAIT_S = 30.0  # bound on every wait of one request
LEAK_CANCELS = 500  # streams cancelled after their first response, to see whether tritonserver grows


@dataclass
class Outcome:
    kind: str  # "grpc" or "http"
    point: str  # where it was cancelled
    responses: int  # responses (gRPC) or SSE events (HTTP) read before cancelling
    finished: bool  # read to the end before the cancel point came
    error: str | None = None


def front_door_in_flight(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    match = re.search(r"^omni_frontdoor_generations_in_flight (\S+)$", text, re.MULTILINE)
    assert match, "omni_frontdoor_generations_in_flight is missing from the front door's metrics"
    return float(match.group(1))


def chat_values(prompt: str) -> dict:
    """A streamed chat request of MAX_TOKENS with ignore_eos, as omni_chat / preprocess tensors."""
    return {"text_input": json.dumps([{"role": "user", "content": prompt}]), "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True}


def preprocessed(grpc_url: str, prompt: str) -> dict[str, np.ndarray]:
    """The llm inputs (input_ids, sampling_params) preprocess makes for a chat prompt."""
    with grpcclient.InferenceServerClient(grpc_url) as client:
        result = client.infer("preprocess", make_inputs(chat_values(prompt), grpcclient))
        return {name: result.as_numpy(name) for name in ("input_ids", "sampling_params")}


def grpc_cancel(grpc_url: str, model: str, request: dict[str, np.ndarray] | str, after: int) -> Outcome:
    """Stream one request to `model`, cancel it after `after` responses (0: right after sending). `request`: the
    llm's input arrays (`preprocessed`) for model llm, the chat prompt for omni_chat (`chat_values`)."""
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    if model == "llm":
        inputs = []
        for name, array in request.items():
            tensor = grpcclient.InferInput(name, list(array.shape), "BYTES" if array.dtype == np.object_ else "INT32")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
    else:
        inputs = make_inputs(chat_values(request), grpcclient)
    received, finished = 0, False
    try:
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        client.async_stream_infer(model, inputs)
        while received < after:
            result, error = events.get(timeout=WAIT_S)
            if error is not None:
                return Outcome("grpc", "stream", received, False, str(error))
            received += 1
            if result.get_response().parameters["triton_final_response"].bool_param:
                finished = True
                break
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    return Outcome("grpc", "stream", received, finished)


HTTP_POINTS = ["partial_body", "after_send", "after_status", "after_events"]


def http_disconnect(port: int, prompt: str, point: str, events_before: int) -> Outcome:
    """POST a streamed chat request to the front door over a raw socket and close it at `point`."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": True,
                       "max_tokens": MAX_TOKENS, "ignore_eos": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    events, finished = 0, False
    try:
        if point == "partial_body":
            sock.sendall(head + body[: len(body) // 2])
            return Outcome("http", point, 0, False)
        sock.sendall(head + body)
        if point == "after_send":
            return Outcome("http", point, 0, False)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return Outcome("http", point, 0, False, "connection closed before the status line")
            data += chunk
        status = data.split(b"\r\n", 1)[0]
        if b" 200 " not in status:
            return Outcome("http", point, 0, False, status.decode(errors="replace"))
        if point == "after_status":
            return Outcome("http", point, 0, False)
        while events < events_before and not finished:
            events = data.count(b"data: ")
            finished = b"data: [DONE]" in data
            if events >= events_before or finished:
                break
            chunk = sock.recv(4096)
            if not chunk:
                return Outcome("http", point, events, False, "connection closed before [DONE]")
            data += chunk
        return Outcome("http", point, events, finished)
    finally:
        sock.close()


def chat(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_cancel_storm_leaves_nothing_behind(make_chat_server):
    server = make_chat_server()
    door = FrontDoorThread(front_door_config(server)).start()
    try:
        before_text = chat(door.url, GREEDY)["choices"][0]["message"]["content"]
        assert "Paris" in before_text
        # the gauges are 0 until the first publication (about 1 s after the stage started)
        start = wait_for(lambda: (m := llm_metrics(server.metrics_url))["omni_kv_cache_blocks_total"] > 0
                         and m["omni_requests_running"] == 0 and m, 10)
        assert start, f"the llm stage did not settle before the storm: {llm_metrics(server.metrics_url)}"
        assert start["omni_kv_cache_blocks_used"] == 0 and start["omni_requests_waiting"] == 0

        rng = random.Random(SEED)
        tensors = [preprocessed(server.grpc_url, p) for p in PROMPTS]
        jobs = []
        for i in range(REQUESTS):
            prompt = rng.randrange(len(PROMPTS))
            after = rng.choice([0, 0, 1, 2]) if rng.random() < 0.4 else rng.randint(1, MAX_TOKENS + 2)
            if i % 4 == 0:
                jobs.append((grpc_cancel, server.grpc_url, "llm", tensors[prompt], after))
            elif i % 4 == 2:
                jobs.append((grpc_cancel, server.grpc_url, "omni_chat", PROMPTS[prompt], after))
            else:
                point = rng.choice(HTTP_POINTS + ["after_send"])  # twice as many closed before the first byte
                jobs.append((http_disconnect, door.config.port, PROMPTS[prompt], point, after))
        rng.shuffle(jobs)
        began = time.monotonic()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            outcomes = list(pool.map(lambda job: job[0](*job[1:]), jobs))
        storm_s = time.monotonic() - began

        errors = [o for o in outcomes if o.error]
        assert not errors, f"requests failed before their cancel point: {errors[:5]}"
        assert sum(o.kind == "grpc" for o in outcomes) == REQUESTS // 2
        cancelled = sum(not o.finished for o in outcomes)
        assert cancelled >= REQUESTS * 0.8, f"only {cancelled} of {REQUESTS} were cancelled"
        assert server.process.poll() is None, f"tritonserver died during the storm:\n{server._log_tail()}"

        settled_at = time.monotonic()
        end = wait_for(lambda: (m := llm_metrics(server.metrics_url))["omni_kv_cache_blocks_used"] == 0
                       and m["omni_requests_running"] == 0 and m["omni_requests_waiting"] == 0 and m, 10)
        assert end, f"the llm stage still holds work 10 s after the storm: {llm_metrics(server.metrics_url)}"
        settle_s = time.monotonic() - settled_at
        assert end["omni_kv_cache_blocks_total"] == start["omni_kv_cache_blocks_total"]
        assert wait_for(lambda: front_door_in_flight(door.url) == 0, 10), "the front door still holds generations"
        after_text = chat(door.url, GREEDY)["choices"][0]["message"]["content"]
        assert after_text == before_text
        assert server.process.poll() is None, f"tritonserver died after the storm:\n{server._log_tail()}"

        # cancelled streams leave nothing in tritonserver either: before the llm stage sent the final flag after a
        # cancellation, Triton kept each cancelled request's state (~31 KiB: 500 cancels grew it by ~15 MiB)
        rss_before = psutil.Process(server.process.pid).memory_info().rss
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            leak_outcomes = list(pool.map(
                lambda i: grpc_cancel(server.grpc_url, "llm", tensors[i % len(tensors)], 1) if i % 2 else
                grpc_cancel(server.grpc_url, "omni_chat", PROMPTS[i % len(PROMPTS)], 1), range(LEAK_CANCELS)))
        assert not [o for o in leak_outcomes if o.error or o.finished]
        grown_mib = (psutil.Process(server.process.pid).memory_info().rss - rss_before) / 2**20
        assert grown_mib < 5, f"tritonserver grew {grown_mib:.1f} MiB over {LEAK_CANCELS} cancelled streams"
        print(f"storm of {REQUESTS} ({cancelled} cancelled) took {storm_s:.1f} s; settled in {settle_s:.1f} s; "
              f"tritonserver grew {grown_mib:.2f} MiB over {LEAK_CANCELS} more cancels")
    finally:
        door.stop()
