"""Cases c01-c06, c11-c17 and c20 of shared/cases/README.md through the front door; each is followed by an
ordinary request that must succeed (a case that leaves the server broken fails even if its answer looked right)."""

import json

import pytest
from front_door import MODEL
from frontdoor_http import get, post, sse

pytestmark = [pytest.mark.server, pytest.mark.reliability]


@pytest.fixture
def api(front_door):
    """POST helper bound to the shared front door; after the test an ordinary chat request must succeed."""

    def call(path, body, **kwargs):
        return post(front_door.url + path, body, **kwargs)

    yield call
    status, _, body = post(front_door.url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3})
    assert status == 200 and body["choices"][0]["message"]["content"], body


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
    assert choice["logprobs"]["tokens"] == []  # prompt logprobs are not produced


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


@pytest.mark.parametrize("model", ["omni_chat", "llm"])
def test_c20_http_infer_on_a_decoupled_model(api, front_door, model):
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]},
                       {"name": "max_tokens", "shape": [1], "datatype": "INT32", "data": [4]}]}
    status, _, answer = api(f"/v2/models/{model}/infer", body)
    assert status == 400
    assert "gRPC streaming" in answer["error"] and "generate_stream" in answer["error"]


def test_c20_generate_returns_only_generated_text(api, triton_server):
    from chat_client import stream_infer

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
