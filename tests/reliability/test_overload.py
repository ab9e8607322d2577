"""Overload: a burst of 4x the llm stage's capacity gets the capacity accepted and the rest refused at once.

The server runs `max_num_seqs` 2 and `max_queued_requests` 2, so the llm stage holds at most 4 requests (2
running, 2 waiting). 16 requests arrive together, first as gRPC streams straight to `llm`, then as HTTP requests
to an OpenAI front door on the same server (half of them streamed). Each accepted request must run to its full
greedy output (`ignore_eos`, so exactly MAX_TOKENS tokens, finish reason "length", the same text as the same
request sent alone afterwards); each refused one must end at once with the stage's "waiting queue is full ...
retry later" (gRPC) or a 429 `rate_limit_error` with `Retry-After` (HTTP). Nothing may hang or be lost:
accepted + refused = sent, and accepted = completed.

The accepted ones take MAX_TOKENS decode steps (seconds on a CPU) while sending the burst takes milliseconds,
so the stage sees every request of a burst while its first four are still held: exactly 4 are accepted.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from helpers.front_door import MODEL, FrontDoorThread, front_door_config
from helpers.llm_stream import LLMStream, llm_inputs

MAX_NUM_SEQS = 2
MAX_QUEUED = 2
CAPACITY = MAX_NUM_SEQS + MAX_QUEUED
BURST = 4 * CAPACITY
MAX_TOKENS = 16
PROMPT = "Tell me a story about a dragon."
REFUSAL_BOUND_S = 2.0  # a refusal comes at once (measured: 0.01 s over gRPC, 0.17 s through the front door)
WAIT_S = 120.0


def chat(url: str, stream: bool) -> dict:
    """One greedy chat request to a front door: {"status", "retry_after", "error", "text", "finish_reason",
    "tokens", "ended_after_s"} (text etc. for a 200; streamed text is joined from the SSE deltas)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as response:
            if not stream:
                answer = json.loads(response.read())
                choice = answer["choices"][0]
                return {"status": response.status, "text": choice["message"]["content"],
                        "finish_reason": choice["finish_reason"], "tokens": answer["usage"]["completion_tokens"],
                        "ended_after_s": time.monotonic() - started}
            text, finish_reason, tokens, done = [], None, None, False
            for raw in response:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                assert "error" not in event, event
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    text.append(choice["delta"].get("content") or "")
                    finish_reason = choice["finish_reason"] or finish_reason
            assert done, "the stream ended without [DONE]"
            return {"status": response.status, "text": "".join(text), "finish_reason": finish_reason,
                    "tokens": tokens, "ended_after_s": time.monotonic() - started}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "retry_after": exc.headers.get("Retry-After"),
                "error": json.loads(exc.read())["error"], "ended_after_s": time.monotonic() - started}


def test_a_burst_of_4x_capacity_gets_capacity_served_and_the_rest_refused_at_once(make_chat_server):
    server = make_chat_server(max_num_seqs=MAX_NUM_SEQS, max_queued_requests=MAX_QUEUED)

    # gRPC streams straight to the llm model
    inputs = [llm_inputs(server.grpc_url, PROMPT, MAX_TOKENS) for _ in range(BURST)]
    streams = [LLMStream(server.grpc_url) for _ in range(BURST)]
    for stream, request_inputs in zip(streams, inputs):
        stream.send(request_inputs)
    burst_s = time.monotonic() - streams[0].sent_at
    with ThreadPoolExecutor(BURST) as pool:
        results = list(pool.map(LLMStream.collect, streams))
    accepted = [r for r in results if r["error"] is None]
    refused = [r for r in results if r["error"] is not None]
    first_done_s = min(r["ended_after_s"] for r in accepted)
    assert burst_s < first_done_s, f"the burst took {burst_s:.2f} s, longer than a request ({first_done_s:.2f} s)"
    assert (len(accepted), len(refused)) == (CAPACITY, BURST - CAPACITY)
    for result in refused:
        assert result["error"] == (f"[queue_full retry_after=1] waiting queue is full: the llm stage holds "
                                   f"{CAPACITY} requests (max_num_seqs {MAX_NUM_SEQS} running + max_queued_requests "
                                   f"{MAX_QUEUED} waiting); retry later")
        assert result["ended_after_s"] < REFUSAL_BOUND_S
    assert max(r["ended_after_s"] for r in refused) < first_done_s
    alone = LLMStream(server.grpc_url)
    alone.send(llm_inputs(server.grpc_url, PROMPT, MAX_TOKENS))
    reference = alone.collect()  # the stage has room again: the same request alone
    assert reference["error"] is None and (reference["tokens"], reference["finish_reason"]) == (MAX_TOKENS, "length")
    assert reference["text"].strip()
    for result in accepted:
        assert (result["text"], result["tokens"], result["finish_reason"]) == (
            reference["text"], MAX_TOKENS, "length")

    # the same burst through an OpenAI front door on this server (its own in-flight limit is far above it)
    door = FrontDoorThread(front_door_config(server)).start()
    try:
        with ThreadPoolExecutor(BURST) as pool:
            answers = list(pool.map(lambda i: chat(door.url, stream=i % 2 == 1), range(BURST)))
        served = [a for a in answers if a["status"] == 200]
        limited = [a for a in answers if a["status"] == 429]
        assert (len(served), len(limited)) == (CAPACITY, BURST - CAPACITY), [a["status"] for a in answers]
        for answer in limited:
            assert answer["retry_after"] == "1"
            assert (answer["error"]["type"], answer["error"]["code"]) == ("rate_limit_error", "rate_limit_exceeded")
            assert answer["error"]["message"].startswith("waiting queue is full: the llm stage holds 4 requests")
            assert answer["ended_after_s"] < REFUSAL_BOUND_S
        for answer in served:
            assert (answer["text"], answer["tokens"], answer["finish_reason"]) == (
                reference["text"], MAX_TOKENS, "length")
        after = chat(door.url, stream=False)  # and a normal request afterwards
        assert (after["status"], after["text"], after["finish_reason"]) == (200, reference["text"], "length")
    finally:
        door.stop()
