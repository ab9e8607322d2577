"""Every case of ../shared/cases/README.md as a test against the real stack (the session's tritonserver with
every model, and its front door); after each test here a normal greedy chat request must still give its exact
answer (`followed_by_a_normal_request` in tests/conftest.py): a case that leaves the server broken fails even if its own answer
looked right.

case -> test
  c01  test_c01_max_tokens_zero_with_echo_and_logprobs
  c02  test_c02_max_tokens_zero_is_handled_per_request
  c03  test_c03_negative_max_tokens
  c04  test_c04_empty_prompt
  c05  test_c05_empty_messages
  c06  test_c06_text_parts_equal_the_joined_string
  c07  test_c07_huge_jpeg_is_resized_and_an_oversize_image_is_refused
  c08  test_c08_mp3_declared_as_wav_decodes_and_text_as_audio_is_unsupported
  c09  test_c09_empty_speech_and_image_inputs
  c10  test_c10_huge_size_is_400_naming_size_and_the_server_stays_up
  c11  test_c11_unknown_model_is_the_same_404_everywhere, test_c11_unknown_model_on_models_endpoint
  c12  test_c12_stop_string_never_streamed
  c13  test_c13_multibyte_text_streams_whole_characters
  c14  test_c14_include_usage_gives_exactly_one_usage_chunk
  c15  test_c15_bad_bodies
  c16  test_c16_out_of_range_settings_name_the_field, test_c16_top_p_one_and_edge_penalties_are_accepted
  c17  test_c17_prompt_longer_than_the_context
  c18  test_c18_disconnect_aborts_generation_and_frees_kv_blocks
  c19  tests/reliability/test_stage_death.py::test_killed_llm_stub_turns_readiness_false_and_ends_requests
       (kills the llm stub of a server of its own; Triton 2.51 does not restart it, so there the request after
       the case must fail fast with a 503 instead of succeeding)
  c20  test_c20_http_infer_on_a_decoupled_model, test_c20_generate_returns_only_generated_text
  c21-c29  tests/reliability/test_cases_second_batch.py
"""

import asyncio
import json
import time

import aiohttp
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from helpers.front_door import MODEL
from helpers.frontdoor_http import get, post, sse
from helpers.llm_metrics import llm_metrics, wait_for
from helpers.media_inputs import (assert_400, assert_ok, audio_bytes, audio_part, chat, image_bytes, image_part, speech,
                          text_only_prompt_tokens)


# The default SmolVLM-shaped model writes an image as <fake_token_around_image><global-img>, 49 <image>,
# <fake_token_around_image>.
IMAGE_TOKENS = 52
"""Placeholder tokens per image (the vision encoder's 7x7 pooled grid)."""

# After every case a normal greedy chat request must give exactly the model's answer (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("followed_by_a_normal_request")


@pytest.fixture
def api(front_door):
    """POST helper bound to the shared front door: (path, body, **post kwargs) -> (status, headers, JSON)."""

    def call(path, body, **kwargs):
        return post(front_door.url + path, body, **kwargs)

    return call


def assert_error(status, body, expected_status, param=None, fragment=None):
    assert status == expected_status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
        assert param.split(".")[0].split("[")[0] in error["message"], error
    if fragment is not None:
        assert fragment in error["message"], error
    return error


def test_c01_max_tokens_zero_with_echo_and_logprobs(api):
    status, _, body = api("/v1/completions", {"model": MODEL, "prompt": "Answer: yes", "max_tokens": 0,
                                              "echo": True, "logprobs": 1})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == "Answer: yes" and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] > 0
    logprobs = choice["logprobs"]  # the prompt's own (c29): one per prompt token, the first without one
    assert "".join(logprobs["tokens"]) == "Answer: yes" and len(logprobs["tokens"]) == body["usage"]["prompt_tokens"]
    assert logprobs["token_logprobs"][0] is None and all(lp <= 0 for lp in logprobs["token_logprobs"][1:])


def test_c02_max_tokens_zero_is_handled_per_request(api, front_door):
    status, _, body = api("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0})
    assert status == 200 and body["choices"][0]["text"] == "" and body["usage"]["completion_tokens"] == 0
    status, events = sse(front_door.url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0,
                                                              "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == ["length"]
    # chat has no echo: 0 tokens is a 400 there, as in the OpenAI API
    status, _, body = api("/v1/chat/completions", {"model": MODEL, "max_tokens": 0,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    assert_error(status, body, 400, "max_tokens")


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"max_tokens": -5, "max_completion_tokens": -1}, None),
])
def test_c03_negative_max_tokens(api, fields, param):
    status, _, body = api("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                   **fields})
    error = assert_error(status, body, 400, param)
    assert error["type"] == "invalid_request_error"
    assert error["param"] in fields and error["param"] in error["message"]


@pytest.mark.parametrize("prompt", [[""], "", [], [[]], ["ok", ""]])
def test_c04_empty_prompt(api, prompt):
    status, _, body = api("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 20})
    assert_error(status, body, 400, "prompt", "must not be empty")


def test_c05_empty_messages(api):
    status, _, body = api("/v1/chat/completions", {"model": MODEL, "messages": []})
    assert_error(status, body, 400, "messages", "non-empty")


def test_c06_text_parts_equal_the_joined_string(api):
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
    common = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    status, _, as_parts = api("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": parts}]})
    assert status == 200, as_parts
    status, _, as_string = api("/v1/chat/completions", {
        **common, "messages": [{"role": "user", "content": "What is the capital\nof France?"}]})
    assert as_parts["usage"]["prompt_tokens"] == as_string["usage"]["prompt_tokens"]
    assert as_parts["choices"][0]["message"] == as_string["choices"][0]["message"]


def test_c07_huge_jpeg_is_resized_and_an_oversize_image_is_refused(front_door):
    text_only_tokens = text_only_prompt_tokens(front_door.url)
    big = np.zeros((8000, 8000, 3), dtype=np.uint8)
    big[::40] = 200
    status, body = chat(front_door.url, image_part(image_bytes("JPEG", big, quality=40), "image/jpeg"))
    assert_ok(status, body)
    assert body["usage"]["prompt_tokens"] == text_only_tokens + IMAGE_TOKENS
    noise = np.random.default_rng(0).integers(0, 256, (2100, 2100, 3), dtype=np.uint8)
    oversize = image_bytes("PNG", noise)
    assert len(oversize) > 10 * 1024 * 1024
    status, body = chat(front_door.url, image_part(oversize))
    assert_400(status, body, "messages[0].content[1]", "limit of 10 MiB")
    small = image_bytes("PNG", (np.arange(32 * 32 * 3) % 256).astype(np.uint8).reshape(32, 32, 3))
    status, body = chat(front_door.url, image_part(small))
    assert_ok(status, body)
    assert body["usage"]["prompt_tokens"] == text_only_tokens + IMAGE_TOKENS


def test_c08_mp3_declared_as_wav_decodes_and_text_as_audio_is_unsupported(front_door):
    samples, rate = speech()
    status, body = chat(front_door.url, audio_part(audio_bytes("MP3", samples, rate), "wav"), text="What was said?")
    assert_ok(status, body)
    text_file = b"Just some text pretending to be audio.\n" * 30
    status, body = chat(front_door.url, audio_part(text_file, "wav"), text="What was said?")
    assert_400(status, body, "messages[0].content[1]", "unsupported audio format")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/audio/speech", {"model": MODEL, "input": "", "voice": "x"}, "input"),
    ("/v1/audio/speech", {"model": MODEL, "input": "hi", "voice": ""}, "voice"),
    ("/v1/images/generations", {"model": MODEL, "prompt": " "}, "prompt"),
])
def test_c09_empty_speech_and_image_inputs(api, front_door, path, body, param):
    status, headers, answer = api(path, body)
    assert status == 400 and headers["content-type"].startswith("application/json"), answer
    error = assert_error(status, answer, 400, param)
    assert param in error["message"] and error["type"] == "invalid_request_error"
    # ordinary speech and image requests still work (the chat request follows every case)
    response = requests.post(front_door.url + "/v1/audio/speech", timeout=180, json={
        "model": MODEL, "input": "Hi there.", "voice": "alloy", "response_format": "wav"})
    assert response.status_code == 200 and response.headers["content-type"] == "audio/wav"
    assert response.content[:4] == b"RIFF" and len(response.content) > 1000
    status, _, answer = api("/v1/images/generations", {"model": MODEL, "prompt": "a cat", "size": "64x64",
                                                       "steps": 2})
    assert status == 200 and answer["data"][0]["b64_json"], answer


def test_c10_huge_size_is_400_naming_size_and_the_server_stays_up(api, triton_server):
    status, headers, body = api("/v1/images/generations",
                                {"model": MODEL, "prompt": "a red bicycle", "size": "100000x10000"})
    assert status == 400 and headers["content-type"].startswith("application/json")
    error = body["error"]
    assert error["param"] == "size" and "size" in error["message"]
    assert "64x64, 128x128, 256x256" in error["message"]  # the allowed sizes
    # the same check in the stage itself (a client talking to Triton directly)
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    inputs = []
    for name, array, datatype in [("prompt", np.array([[b"a red bicycle"]], dtype=object), "BYTES"),
                                  ("width", np.array([[100000]], np.int32), "INT32"),
                                  ("height", np.array([[10000]], np.int32), "INT32")]:
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    with httpclient.InferenceServerClient(triton_server.http_url) as client:
        with pytest.raises(InferenceServerException, match="size 100000x10000 is not supported"):
            client.infer("text2image", inputs)
    status, _, body = api("/v1/images/generations", {"model": MODEL, "prompt": "a red bicycle", "size": "64x64",
                                                     "steps": 3})
    assert status == 200 and body["data"][0]["b64_json"]


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
])
def test_undecodable_media_parts_are_refused_by_name(api, part):
    content = [{"type": "text", "text": "What is this?"}, part]
    status, _, body = api("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": content}]})
    assert_error(status, body, 400, "messages[0].content[1]", part["type"])


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/images/generations", {"prompt": "a red bicycle"}),
    ("/v1/audio/speech", {"input": "hi", "voice": "x"}),
    ("/v1/audio/transcriptions", {}),
    ("/v1/embeddings", {"input": "hi"}),
])
def test_c11_unknown_model_is_the_same_404_everywhere(api, path, body):
    status, _, answer = api(path, {"model": "does-not-exist", **body})
    assert status == 404
    assert answer == {"error": {"message": "The model `does-not-exist` does not exist.",
                                "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}


def test_c11_unknown_model_on_models_endpoint(api, front_door):
    status, _, text = get(front_door.url + "/v1/models/does-not-exist")
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"


def test_c12_stop_string_never_streamed(api, front_door):
    body = {"model": MODEL, "prompt": "The alphabet: ABC", "temperature": 0, "stop": ["DEFGHIJ"], "max_tokens": 20}
    status, whole = api("/v1/completions", body)[::2]
    assert status == 200
    status, events = sse(front_door.url + "/v1/completions", {**body, "stream": True})
    chunks = [e for e in events if e != "[DONE]"]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == whole["choices"][0]["text"]
    assert not any(set(c["choices"][0]["text"]) & set("DEFGHIJ") for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert whole["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "你好世界 🌶️ 你好世界 🌶️ 你好世界 🌶️", "max_tokens": 24}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say 你好世界 🌶️ three times."}],
                              "max_tokens": 30}),
])
def test_c13_multibyte_text_streams_whole_characters(api, front_door, path, body):
    body = {"model": MODEL, "temperature": 0, **body}
    status, whole = api(path, body)[::2]
    assert status == 200
    status, events = sse(front_door.url + path, {**body, "stream": True})
    chunks = [e for e in events if e != "[DONE]"]
    if "messages" in body:
        deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks]
        expected = whole["choices"][0]["message"]["content"]
    else:
        deltas = [c["choices"][0]["text"] for c in chunks]
        expected = whole["choices"][0]["text"]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas).encode("utf-8") == expected.encode("utf-8")
    assert any(ord(ch) > 0xFFFF or 0x4E00 <= ord(ch) <= 0x9FFF for ch in expected), expected


def test_c14_include_usage_gives_exactly_one_usage_chunk(api, front_door):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 5, "stream": True}
    status, events = sse(front_door.url + "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("usage" in c for c in chunks)
    with_usage = [c for c in chunks if c["usage"] is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    status, events = sse(front_door.url + "/v1/chat/completions", {**body, "stream_options": {}})
    assert not any(isinstance(c, dict) and c.get("usage") for c in events)
    assert all(c == "[DONE]" or c["choices"] for c in events)
    status, events = sse(front_door.url + "/v1/completions", {
        "model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
    assert [c for c in events[:-1] if c["usage"]] == [events[-2]] and events[-2]["choices"] == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("raw, headers, expected", [
    (b'{"model": "omni_chat", "messages": [', {"Content-Type": "application/json"}, 400),
    (json.dumps({"model": MODEL, "prompt": "hi"}).encode(), {}, 415),
    (json.dumps({"model": MODEL, "prompt": "hi"}).encode(), {"Content-Type": "text/plain"}, 415),
    (b"[]", {"Content-Type": "application/json"}, 400),
    (b"null", {"Content-Type": "application/json"}, 400),
    (b"123", {"Content-Type": "application/json"}, 400),
    (b'"text"', {"Content-Type": "application/json"}, 400),
    (b'{"model": "omni_chat", "prompt": "\\ud800", "messages": [{"role": "user", "content": "\\ud800"}]}',
     {"Content-Type": "application/json"}, 400),
    (b'{"model": "omni_chat", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "stop": "\\udfff"}',
     {"Content-Type": "application/json"}, 400),
    (b"\xff\xfe{}", {"Content-Type": "application/json"}, 400),
])
def test_c15_bad_bodies(api, path, raw, headers, expected):
    status, _, body = api(path, raw, headers=headers)
    assert_error(status, body, expected)


@pytest.mark.parametrize("fields, param", [
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
])
def test_c16_out_of_range_settings_name_the_field(api, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    status, _, answer = api("/v1/chat/completions", body)
    assert_error(status, answer, 400, param)


def test_c16_top_p_one_and_edge_penalties_are_accepted(api):
    for fields in ({"top_p": 1.0}, {"presence_penalty": 2, "frequency_penalty": -2}, {"repetition_penalty": 1.2}):
        status, _, body = api("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hi"}], **fields})
        assert status == 200, (fields, body)


def test_c17_prompt_longer_than_the_context(api, openai_client):
    max_model_len = openai_client.models.retrieve(MODEL).max_model_len
    assert max_model_len == 2048  # the fixture's setting, read back from Triton's llm config
    long_text = "word " * (max_model_len + 100)
    status, _, body = api("/v1/chat/completions", {"model": MODEL, "max_tokens": max_model_len,
                                                   "messages": [{"role": "user", "content": long_text}]})
    error = assert_error(status, body, 400, "messages", f"maximum context length is {max_model_len} tokens")
    assert "you requested" in error["message"] and error["code"] == "context_length_exceeded"
    status, _, body = api("/v1/completions", {"model": MODEL, "prompt": long_text, "max_tokens": 10})
    assert_error(status, body, 400, "prompt", f"maximum context length is {max_model_len} tokens")


def _engine_slots(triton_server) -> int:
    """max_num_seqs of the llm stage, read from its config in Triton."""
    with grpcclient.InferenceServerClient(triton_server.grpc_url) as client:
        config = client.get_model_config("llm", as_json=True)["config"]
    return int(config["parameters"]["max_num_seqs"]["string_value"])


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_c18_disconnect_aborts_generation_and_frees_kv_blocks(front_door, triton_server, stream):
    """Fill every engine slot with long generations, drop their connections: the KV blocks go back to the level
    before (0 on the idle session server) and a new request starts at once. Without cancellation the engine
    would go on with thousands of tokens (minutes on this CPU) holding every slot."""
    slots = _engine_slots(triton_server)
    metrics_url = triton_server.metrics_url

    def idle() -> bool:
        gauges = llm_metrics(metrics_url)
        return gauges["omni_kv_cache_blocks_used"] == 0 and gauges["omni_requests_running"] == 0

    def all_running() -> bool:
        gauges = llm_metrics(metrics_url)
        return gauges["omni_requests_running"] == slots and gauges["omni_kv_cache_blocks_used"] >= slots

    assert wait_for(idle, 15), f"the session server is not idle before the case: {llm_metrics(metrics_url)}"
    long = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1200, "ignore_eos": True,
            "stream": stream}

    async def run():
        async with aiohttp.ClientSession() as session:
            if stream:
                responses = await asyncio.gather(*[session.post(front_door.url + "/v1/completions", json=long)
                                                   for _ in range(slots)])
                for response in responses:
                    assert response.status == 200
                    await response.content.readline()  # generating now
            else:
                tasks = [asyncio.ensure_future(session.post(front_door.url + "/v1/completions", json=long))
                         for _ in range(slots)]
            # all admitted and decoding: every slot holds KV blocks
            assert await asyncio.to_thread(wait_for, all_running, 30), \
                f"the long requests never all ran: {llm_metrics(metrics_url)}"
            if stream:
                for response in responses:
                    response.close()
            else:
                assert not any(t.done() for t in tasks)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        dropped = time.monotonic()
        assert await asyncio.to_thread(wait_for, idle, 10), \
            f"KV blocks not freed 10 s after the disconnects: {llm_metrics(metrics_url)}"
        freed_s = time.monotonic() - dropped
        started = time.monotonic()
        async with aiohttp.ClientSession() as session:
            async with session.post(front_door.url + "/v1/completions", json={
                    "model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True}) as response:
                await asyncio.wait_for(response.content.readline(), timeout=10)
                first = time.monotonic() - started
                await response.read()
        return freed_s, first

    try:
        freed_s, first_chunk_s = asyncio.run(run())
    except TimeoutError:
        pytest.fail("the next request got no first token within 10 s: the dropped requests still hold the engine")
    assert first_chunk_s < 5.0, f"the next request waited {first_chunk_s:.1f} s for the engine"
    print(f"KV blocks back to 0 within {freed_s:.1f} s; next first chunk after {first_chunk_s:.2f} s")


@pytest.mark.parametrize("model", ["omni_chat", "llm"])
def test_c20_http_infer_on_a_decoupled_model(api, front_door, model):
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]},
                       {"name": "max_tokens", "shape": [1], "datatype": "INT32", "data": [4]}]}
    status, _, answer = api(f"/v2/models/{model}/infer", body)
    assert status == 400
    assert "gRPC streaming" in answer["error"] and "generate_stream" in answer["error"]


def test_c20_generate_returns_only_generated_text(api, triton_server):
    from helpers.chat_client import stream_infer

    prompt = "The capital of France is"
    status, _, answer = api("/v2/models/omni_chat/generate", {"text_input": prompt, "max_tokens": 8,
                                                               "temperature": 0})
    assert status == 200, answer
    direct = stream_infer(triton_server.grpc_url, {"text_input": prompt, "max_tokens": 8, "temperature": 0.0})
    assert answer["text_output"] == direct.text and not answer["text_output"].startswith(prompt)
    status, _, answer = api("/v2/models/omni_chat/generate", {"text_input": prompt, "max_tokens": 8,
                                                               "stream": True})
    assert status == 400 and "generate_stream" in answer["error"]


def test_chat_without_max_tokens_generates_up_to_the_context(api):
    """No max_tokens: the front door asks for the rest of the context, which the engine's KV cache must be able
    to hold (the test server's cache is sized for max_model_len, as the default settings are)."""
    status, _, body = api("/v1/chat/completions", {"model": MODEL, "temperature": 0,
                                                   "messages": [{"role": "user", "content": "Say hi."}]})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["message"]["content"]
