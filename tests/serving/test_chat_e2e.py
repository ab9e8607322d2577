"""Issue 2 acceptance: omni_chat answers through a real tritonserver, streamed and not, alone and concurrently."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.chat_client import chat_messages, http_generate, stream_infer

pytestmark = pytest.mark.server

FRANCE = chat_messages("What is the capital of France?")
GREEDY = {"temperature": 0.0}


def test_streamed_greedy_answer_and_http_generate_agree(triton_server):
    streamed = stream_infer(triton_server.grpc_url, {"text_input": FRANCE, "max_tokens": 32, "stream": True, **GREEDY})
    assert streamed.error is None
    assert "Paris" in streamed.text
    assert len(streamed.responses) > 1, "a streamed request sends several deltas"
    assert all(r["finish_reason"].reshape(-1)[0] == b"" for r in streamed.responses[:-1])
    assert streamed.last("finish_reason") in ("stop", "length")
    assert streamed.last("completion_tokens") <= 32 and streamed.last("prompt_tokens") > 0

    status, body = http_generate(triton_server.http_url, {"text_input": FRANCE, "max_tokens": 32, **GREEDY})
    assert status == 200, body
    assert body["text_output"] == streamed.text
    assert body["finish_reason"] == streamed.last("finish_reason")
    assert body["completion_tokens"] == streamed.last("completion_tokens")
    assert body["prompt_tokens"] == streamed.last("prompt_tokens")


def test_non_streamed_grpc_request_gets_one_response(triton_server):
    result = stream_infer(triton_server.grpc_url, {"text_input": FRANCE, "max_tokens": 32, **GREEDY})
    assert result.error is None and len(result.responses) == 1
    assert "Paris" in result.text


PROMPTS = [
    chat_messages("What is the capital of France?"),
    chat_messages("Name three colors."),
    chat_messages("Write a haiku about the sea."),
    chat_messages("What is 2 + 2?"),
    "The quick brown fox",
    chat_messages("Tell me about cats."),
    "Once upon a time",
    chat_messages("How do airplanes fly?"),
]


def test_concurrent_streams_equal_their_solo_results(triton_server):
    def run(prompt):
        result = stream_infer(triton_server.grpc_url, {"text_input": prompt, "max_tokens": 24, "stream": True, **GREEDY})
        assert result.error is None, result.error
        return result.text

    solo = [run(prompt) for prompt in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(run, PROMPTS))
    assert together == solo
    assert len(set(solo)) == len(solo)


def test_optional_inputs_reach_the_engine(triton_server):
    base = {"text_input": FRANCE, "max_tokens": 32, **GREEDY}
    stopped = stream_infer(triton_server.grpc_url, {**base, "stop_words": ["Paris"], "stream": True})
    assert stopped.error is None
    assert "Paris" not in stopped.text and stopped.last("finish_reason") == "stop"

    capped = stream_infer(triton_server.grpc_url, {**base, "max_tokens": 3})
    assert capped.last("completion_tokens") == 3 and capped.last("finish_reason") == "length"

    seeded = {"text_input": FRANCE, "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "top_k": 50}
    first = stream_infer(triton_server.grpc_url, {**seeded, "random_seed": 1234})
    again = stream_infer(triton_server.grpc_url, {**seeded, "random_seed": 1234})
    assert first.error is None and first.text == again.text


def test_logprobs_carry_tokens_and_exact_bytes(triton_server):
    result = stream_infer(triton_server.grpc_url,
                          {"text_input": FRANCE, "max_tokens": 16, "stream": True, "logprobs": 2, **GREEDY})
    assert result.error is None
    entries = [e for r in result.responses for e in json.loads(r["output_logprobs"].reshape(-1)[0] or b"[]")]
    assert len(entries) == result.last("completion_tokens") or result.last("finish_reason") == "stop"
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in entries)
    assert all(e["logprob"] == pytest.approx(e["top_logprobs"][0]["logprob"]) for e in entries)  # greedy
    assert b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8").startswith(result.text)
