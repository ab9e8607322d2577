"""Prefix caching seen from outside: `usage.prompt_tokens_details.cached_tokens` through the front door (chat and
completions, whole and streamed), the llm model's `cached_tokens` output, and the operator's reset
(`POST /reset_prefix_cache` on the front door, the llm model's `reset_prefix_cache` input on Triton).

Every test starts its prompt with a nonce of its own, inside the first KV block (16 tokens), so no earlier
request of the session shares a cached prefix with it (chat prompts would otherwise share the chat template's
default system prompt). A repeat of an N-token prompt after its first copy finished reuses every full block
short of its last token: ((N - 1) // 16) * 16 tokens.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from helpers.chat_client import stream_inputs
from helpers.front_door import MODEL
from helpers.frontdoor_http import post, sse
from helpers.llm_stream import llm_inputs

from omni_backend.operator_key import ADMIN_KEY_HEADER

pytestmark = pytest.mark.server

BLOCK_SIZE = 16  # the test server's KV block (repository default)
STORY = ("Long ago, in a valley between two rivers, a clockmaker named Ilse kept a shop full of ticking wonders. "
         "Every morning she wound a hundred clocks, and every evening she listened to them chime together, "
         "checking by ear that none had drifted. One winter a stranger brought her a clock with no hands at all, "
         "asking her to make it tell the time again. Describe what Ilse did next, step by step.")


def reused(prompt_tokens: int) -> int:
    """The prompt tokens a repeat finds cached once the first copy finished: its full blocks short of the last
    token."""
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def nonce() -> str:
    return f"Session {uuid.uuid4().hex[:8]}."


def chat_body(session: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "system", "content": f"{session} You answer briefly."},
                                         {"role": "user", "content": STORY}],
            "max_tokens": 8, "temperature": 0, **extra}


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_a_repeated_chat_prompt_reports_its_cached_tokens(front_door):
    body = chat_body(nonce())
    status, _, first = post(front_door.url + "/v1/chat/completions", body)
    assert status == 200, first
    status, _, second = post(front_door.url + "/v1/chat/completions", body)
    assert status == 200, second
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens >= 80 and second["usage"]["prompt_tokens"] == prompt_tokens
    assert (cached(first["usage"]), cached(second["usage"])) == (0, reused(prompt_tokens))
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert second["usage"]["completion_tokens"] == first["usage"]["completion_tokens"] > 0


def test_the_streamed_usage_chunk_reports_cached_tokens(front_door):
    """Completions with logprobs: every llm response goes through postprocess, which passes the count on."""
    body = {"model": MODEL, "prompt": f"{nonce()} {STORY}", "max_tokens": 6, "ignore_eos": True, "temperature": 0,
            "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}}
    answers = []
    for _ in range(2):
        status, events = sse(front_door.url + "/v1/completions", body)
        assert status == 200 and events[-1] == "[DONE]"
        usage = events[-2]["usage"]
        text = "".join(c["text"] for e in events[:-2] for c in e["choices"])
        answers.append((usage, text, [t for e in events[:-2] for c in e["choices"] if c["logprobs"]
                                      for t in c["logprobs"]["tokens"]]))
    (first, text, tokens), (second, text_again, tokens_again) = answers
    assert first["prompt_tokens"] >= 80 and second["prompt_tokens"] == first["prompt_tokens"]
    assert (cached(first), cached(second)) == (0, reused(first["prompt_tokens"]))
    assert text_again == text and tokens_again == tokens and len(tokens) == first["completion_tokens"] == 6


def test_the_operator_resets_the_prefix_cache(front_door, triton_server, make_front_door):
    body = chat_body(nonce())
    status, _, first = post(front_door.url + "/v1/chat/completions", body)
    assert status == 200 and cached(first["usage"]) == 0, first
    for headers in ({}, {ADMIN_KEY_HEADER: "wrong"}):
        status, _, refused = post(front_door.url + "/reset_prefix_cache", None, headers=headers)
        assert status == 403 and ADMIN_KEY_HEADER in refused["error"]["message"], refused
    status, _, again = post(front_door.url + "/v1/chat/completions", body)  # the refusals dropped nothing
    assert cached(again["usage"]) == reused(first["usage"]["prompt_tokens"])

    status, _, answer = post(front_door.url + "/reset_prefix_cache", None,
                             headers={ADMIN_KEY_HEADER: triton_server.admin_key})
    assert status == 200, answer
    assert list(answer) == ["dropped_blocks"] and answer["dropped_blocks"] >= first["usage"]["prompt_tokens"] // 16
    status, _, cold = post(front_door.url + "/v1/chat/completions", body)
    assert status == 200 and cached(cold["usage"]) == 0, cold
    assert cold["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]

    keyed = make_front_door(api_key="sekret")  # the API key is checked first, as on /v2
    status, _, refused = post(keyed.url + "/reset_prefix_cache", None, headers={ADMIN_KEY_HEADER: triton_server.admin_key})
    assert status == 401, refused
    status, _, answer = post(keyed.url + "/reset_prefix_cache", None, headers={
        ADMIN_KEY_HEADER: triton_server.admin_key, "Authorization": "Bearer sekret"})
    assert status == 200 and answer["dropped_blocks"] > 0, answer  # the cold request's blocks


def test_the_llm_model_reports_cached_tokens_and_resets_only_for_the_operator(triton_server):
    inputs = llm_inputs(triton_server.grpc_url, f"{nonce()} {STORY}", max_tokens=4, chat=False)
    prompt_tokens = inputs[0].shape()[0]
    counts = []
    for _ in range(2):
        result = stream_inputs(triton_server.grpc_url, inputs, "llm")
        assert result.error is None, result.error
        assert result.last("prompt_tokens") == prompt_tokens and result.last("completion_tokens") == 4
        assert {r["cached_tokens"].dtype for r in result.responses} == {np.dtype(np.int32)}
        counts.append(result.last("cached_tokens"))
    assert counts == [0, reused(prompt_tokens)]

    reset = grpcclient.InferInput("reset_prefix_cache", [1], "BOOL")
    reset.set_data_from_numpy(np.array([True]))
    for parameters in (None, {ADMIN_KEY_HEADER: "wrong"}):
        refused = stream_inputs(triton_server.grpc_url, [reset], "llm", parameters=parameters)
        assert refused.error.startswith(f"[invalid_argument field={ADMIN_KEY_HEADER}] {ADMIN_KEY_HEADER} "), refused.error
    done = stream_inputs(triton_server.grpc_url, [reset], "llm", parameters={ADMIN_KEY_HEADER: triton_server.admin_key})
    assert done.error is None and list(done.responses[0]) == ["dropped_blocks"]
    assert done.last("dropped_blocks") >= prompt_tokens // 16
    assert stream_inputs(triton_server.grpc_url, inputs, "llm").last("cached_tokens") == 0

    # input_ids and sampling_params are optional in the config for the reset only: a generation request
    # without one is still refused, naming it
    missing = stream_inputs(triton_server.grpc_url, [i for i in inputs if i.name() != "input_ids"], "llm")
    assert missing.error.startswith("[invalid_argument field=input_ids] input_ids is required"), missing.error
    both = stream_inputs(triton_server.grpc_url, [reset, *inputs], "llm",
                         parameters={ADMIN_KEY_HEADER: triton_server.admin_key})
    assert both.error.startswith("[invalid_argument field=reset_prefix_cache] reset_prefix_cache is a request of "
                                 "its own"), both.error
