"""The second batch of ../shared/cases/README.md (c21-c29) as tests against the real stack (the session's
tritonserver with every model, and its front door); after each test a normal greedy chat request must still give
its exact answer (`followed_by_a_normal_request`, tests/conftest.py). Each covers the whole kind of fault.

case -> test
  c21  test_c21_integers_beyond_their_tensor_type_are_400_never_narrowed
  c22  test_c22_generate_bodies_are_typed_before_triton_parses_them
  c23  test_c23_admin_apis_need_the_operators_key_inference_stays_open,
       test_c23_grpc_admin_protocols_need_the_operators_key
  c24  test_c24_speech_input_must_be_speakable
  c25  test_c25_null_is_the_default_and_types_are_strict
  c26  test_c26_head_on_get_routes, test_c26_cors_preflight_follows_the_allowed_origins
  c27  test_c27_content_encoding
  c28  test_c28_base64_with_or_without_padding
  c29  test_c29_echo_with_prompt_logprobs (and c01's max_tokens 0 in tests/reliability/test_cases.py)
"""

from __future__ import annotations

import base64
import gzip
import json
import zlib

import numpy as np
import pytest
import requests
from helpers.front_door import MODEL
from helpers.frontdoor_http import post, sse
from helpers.media_inputs import assert_ok, audio_bytes, chat, image_bytes

from omni_backend.operator_key import ADMIN_KEY_HEADER, GRPC_ADMIN_KEY_HEADER

pytestmark = pytest.mark.usefixtures("followed_by_a_normal_request")

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}


def generate(url: str, body, **headers) -> tuple[int, dict]:
    """POST /v2/models/omni_chat/generate at `url` (http://host:port) with a JSON body."""
    response = requests.post(f"{url}/v2/models/{MODEL}/generate", data=json.dumps(body),
                             headers={"Content-Type": "application/json", **headers}, timeout=120)
    return response.status_code, response.json()


@pytest.mark.parametrize("value", [4294967304, -4294967288, 2147483648, 2**64 + 8])
def test_c21_integers_beyond_their_tensor_type_are_400_never_narrowed(front_door, value):
    """Triton's own JSON parser casts 4294967304 to the INT32 8 (and -4294967288 too) and serves 8 tokens; the
    front door's /v2 checks every integer against its tensor's type and its setting's range first."""
    status, body = generate(front_door.url, {"text_input": "Once upon a time", "max_tokens": value})
    assert status == 400, body
    assert body["error"].startswith("max_tokens must be an integer in [1, 2147483647]"), body
    # the same kind through the OpenAI endpoints (INT32 and SamplingParams' range, one vocabulary)
    for path, extra in (("/v1/completions", {"prompt": "Once upon a time"}), ("/v1/chat/completions",
                                                                            {"messages": CHAT["messages"]})):
        status, _, answer = post(front_door.url + path, {"model": MODEL, "max_tokens": value, **extra})
        assert status == 400 and answer["error"]["param"] == "max_tokens", answer
    # every INT32/UINT64 input of the ensemble, not only max_tokens
    for name, bad in (("top_k", 2**31), ("logprobs", 2**32 + 1), ("random_seed", 2**64), ("prompt_logprobs", -1)):
        status, body = generate(front_door.url, {"text_input": "Hi", "max_tokens": 2, name: bad})
        assert status == 400 and body["error"].startswith(f"{name} must be an integer in"), body


def test_c21_triton_http_refuses_what_it_does_not_narrow(triton_server):
    """Directly on Triton's HTTP port, a value it reads as a negative INT32 is refused by preprocess, naming
    max_tokens (docs/api.md: Triton 2.51 narrows some out-of-range integers before any model sees them, which is
    why public HTTP clients use the front door's /v2)."""
    status, body = generate(f"http://{triton_server.http_url}", {"text_input": "Hi", "max_tokens": 2147483648})
    assert status == 400 and "max_tokens must be an integer in [1, inf)" in body["error"], body


@pytest.mark.parametrize("field, value, expected", [
    ("max_tokens", "abc", "max_tokens must be an integer in"),
    ("max_tokens", 3.5, "max_tokens must be an integer in"),
    ("max_tokens", True, "max_tokens must be an integer in"),
    ("max_tokens", None, "max_tokens must be an integer in"),
    ("temperature", "0.1", "temperature must be a finite number in"),
    ("random_seed", -1, "random_seed must be an integer in [0, 9223372036854775807], got -1"),
    ("text_input", 123, "text_input must be a string, got 123"),
    ("stream", "yes", "stream must be a boolean, got 'yes'"),
    ("stop_words", ["ok", 5], "stop_words must be a string, got 5"),
    ("random_seed", [[]], "random_seed takes 1 value(s), got 0"),  # schemathesis: Triton's 500 "Shape does not match"
    ("max_tokens", [2, 3], "max_tokens takes 1 value(s), got 2"),
])
def test_c22_generate_bodies_are_typed_before_triton_parses_them(front_door, field, value, expected):
    """Triton answers these 500 "Unable to parse 'data'"; through the front door each is a 400 naming the input
    and the type it takes. A body without a required input is a 400 too (2.51 could leave it unanswered)."""
    status, body = generate(front_door.url, {"text_input": "Hi", "max_tokens": 2, field: value})
    assert status == 400 and body["error"].startswith(expected), body
    status, body = generate(front_door.url, {"max_tokens": 2, "temperature": 0.5})
    assert status == 400 and body["error"].startswith("text_input is required"), body
    status, body = generate(front_door.url, {"text_input": "Hi", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["text_output"], body


ADMIN_CALLS = [
    ("POST", "/v2/logging", {"log_verbose_level": 0}),
    ("POST", "/v2/trace/setting", {}),
    ("POST", "/v2/systemsharedmemory/region/x/register", {"key": "/x", "offset": 0, "byte_size": 8}),
    ("POST", "/v2/repository/index", {}),
    ("POST", "/v2/repository/models/omni_chat/unload", {}),
]


@pytest.mark.parametrize("method, path, body", ADMIN_CALLS)
def test_c23_admin_apis_need_the_operators_key_inference_stays_open(front_door, triton_server, method, path, body):
    for base in (front_door.url, f"http://{triton_server.http_url}"):
        response = requests.request(method, base + path, json=body, timeout=30)
        assert response.status_code in (403, 404), (base, path, response.status_code, response.text)
        assert "omni_chat" not in response.text or "unload" in path  # nothing of the repository leaks
    if path.endswith("/unload"):  # not with the key either: it would take the session's model away
        return
    for base in (front_door.url, f"http://{triton_server.http_url}"):
        response = requests.request(method, base + path, json=body, timeout=30,
                                    headers={ADMIN_KEY_HEADER: triton_server.admin_key})
        assert response.status_code not in (401, 403), (base, path, response.status_code, response.text)
    status = requests.post(front_door.url + "/v2/logging", json={}, timeout=30,
                           headers={ADMIN_KEY_HEADER: "wrong"}).status_code
    assert status == 403
    # inference, metadata, config, health and ready stay open on both ports
    for base in (front_door.url, f"http://{triton_server.http_url}"):
        for open_path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}", f"/v2/models/{MODEL}/config",
                          f"/v2/models/{MODEL}/ready"):
            assert requests.get(base + open_path, timeout=30).status_code == 200, (base, open_path)
        status, answer = generate(base, {"text_input": "Hi", "max_tokens": 2})
        assert status == 200 and answer["text_output"], answer


def test_c23_grpc_admin_protocols_need_the_operators_key(triton_server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    key = {GRPC_ADMIN_KEY_HEADER: triton_server.admin_key}
    with grpcclient.InferenceServerClient(triton_server.grpc_url) as client:
        for call in (lambda h: client.get_log_settings(headers=h), lambda h: client.get_trace_settings(headers=h),
                     lambda h: client.get_model_repository_index(headers=h),
                     lambda h: client.get_system_shared_memory_status(headers=h)):
            with pytest.raises(InferenceServerException) as excinfo:
                call(None)
            assert excinfo.value.status() in ("StatusCode.PERMISSION_DENIED", "StatusCode.UNAVAILABLE"), \
                excinfo.value
            call(key)  # the operator's key opens it
        assert client.is_server_ready() and client.is_model_ready(MODEL)
        assert client.get_model_metadata(MODEL).name == MODEL


@pytest.mark.parametrize("text, fragment", [
    ("Hello\u0000 world", "control character U+0000"),
    ("Hi\u001b[31m there", "control character U+001B"),
    ("-", "nothing to speak"),
    ("\u200b\u200b", "nothing to speak"),
    ("…", "nothing to speak"),
    ("?! ... --", "nothing to speak"),
])
def test_c24_speech_input_must_be_speakable(front_door, triton_server, text, fragment):
    status, _, body = post(front_door.url + "/v1/audio/speech", {"model": "tts-1", "input": text, "voice": "alloy"})
    assert status == 400 and body["error"]["param"] == "input" and fragment in body["error"]["message"], body
    # the tts stage refuses it the same way for Triton's own clients (never a 200 with zero samples)
    import tritonclient.grpc as grpcclient

    from omni_backend.vocabulary import ErrorKind, StageError

    responses = []
    with grpcclient.InferenceServerClient(triton_server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.append((result, error)))
        tensor = grpcclient.InferInput("text", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode()], dtype=object))
        client.async_stream_infer("tts", [tensor])
        client.stop_stream()
    errors = [StageError.parse(error.message()) for _, error in responses if error is not None]
    assert errors and (errors[0].kind, errors[0].field) == (ErrorKind.INVALID_ARGUMENT, "text"), responses
    # zero-width characters are removed, speakable text around them is spoken
    response = requests.post(front_door.url + "/v1/audio/speech", timeout=120, json={
        "model": "tts-1", "input": "Hi\u200b there.", "voice": "alloy", "response_format": "wav"})
    assert response.status_code == 200 and len(response.content) > 10_000


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "n": None, "stream": None, "logprobs": None, "temperature": None,
                              "seed": None, "stop": None, "stream_options": None, "top_logprobs": None}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": None, "echo": None, "n": None,
                         "logprobs": None, "best_of": None, "suffix": None, "presence_penalty": None}),
    ("/v1/images/generations", {"model": MODEL, "prompt": "a cat", "size": "64x64", "steps": 1, "n": None,
                                "seed": None, "response_format": None}),
])
def test_c25_null_is_the_default_and_types_are_strict(front_door, path, body):
    status, _, answer = post(front_door.url + path, body)
    assert status == 200, answer
    if path == "/v1/completions":  # max_tokens null is OpenAI's default of 16, not "until the context ends"
        assert answer["usage"]["completion_tokens"] <= 16 and answer["choices"][0]["logprobs"] is None
    for field, value in (("stream", "yes"), ("n", "2"), ("max_tokens", "3"), ("temperature", "0.5"),
                         ("stream", 1)):
        if path == "/v1/images/generations" and field != "n":
            continue
        status, _, answer = post(front_door.url + path, {**body, field: value})
        assert status == 400 and answer["error"]["param"] == field, (field, value, answer)


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", f"/v1/models/{MODEL}", "/v2/health/ready",
                                  f"/v2/models/{MODEL}"])
def test_c26_head_on_get_routes(front_door, path):
    got = requests.get(front_door.url + path, timeout=30)
    head = requests.head(front_door.url + path, timeout=30)
    assert head.status_code == got.status_code == 200, (head.status_code, got.status_code)
    assert head.content == b"" and (got.content or path.startswith("/v2/health"))
    assert head.headers["content-type"] == got.headers["content-type"]


def test_c26_cors_preflight_follows_the_allowed_origins(front_door, make_front_door):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    # default: CORS off, the preflight is answered (not 405) and allows nothing
    response = requests.options(front_door.url + "/v1/chat/completions", headers=preflight, timeout=30)
    assert response.status_code == 400 and "access-control-allow-origin" not in response.headers
    door = make_front_door(allowed_origins=("https://app.example",))
    response = requests.options(door.url + "/v1/chat/completions", headers=preflight, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "authorization" in response.headers["access-control-allow-headers"].lower()
    other = requests.options(door.url + "/v1/chat/completions", timeout=30,
                             headers={**preflight, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    answer = requests.post(door.url + "/v1/chat/completions", json=CHAT, timeout=120,
                           headers={"Origin": "https://app.example"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example"


def test_c27_content_encoding(front_door, make_front_door):
    body = json.dumps({**CHAT, "temperature": 0}).encode()
    url = front_door.url + "/v1/chat/completions"
    plain = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=120).json()
    for coding, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)),
                         ("deflate", zlib.compress(body)[2:-4])):  # zlib-wrapped, and raw deflate as some send it
        response = requests.post(url, data=data, timeout=120,
                                 headers={"Content-Type": "application/json", "Content-Encoding": coding})
        assert response.status_code == 200, (coding, response.text)
        assert response.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    mislabelled = requests.post(url, data=body, timeout=30,
                                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert mislabelled.status_code == 400 and "gzip" in mislabelled.json()["error"]["message"]
    assert mislabelled.json()["error"]["code"] == "invalid_content_encoding"
    truncated = requests.post(url, data=gzip.compress(body)[:-12], timeout=30,
                              headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert truncated.status_code == 400
    unknown = requests.post(url, data=body, timeout=30,
                            headers={"Content-Type": "application/json", "Content-Encoding": "br"})
    assert unknown.status_code == 415 and "br" in unknown.json()["error"]["message"]
    # a 50 MB bomb in 50 kB: the limit (32 MiB) applies to the decompressed body, and decoding stops there
    bomb = gzip.compress(b'{"model": "omni_chat", "prompt": "' + b" " * (50 * 1024 * 1024) + b'"}', 9)
    assert len(bomb) < 100_000
    response = requests.post(front_door.url + "/v1/completions", data=bomb, timeout=60,
                             headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert response.status_code == 413 and "after decompression" in response.json()["error"]["message"]
    # /v2 bodies too (forwarded decoded)
    response = requests.post(front_door.url + f"/v2/models/{MODEL}/generate", timeout=120,
                             data=gzip.compress(json.dumps({"text_input": "Hi", "max_tokens": 2}).encode()),
                             headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert response.status_code == 200 and response.json()["text_output"]


def _unpadded(raw: bytes) -> str:
    text = base64.b64encode(raw).decode()
    assert text.endswith("="), "pick data whose base64 has padding"
    return text.rstrip("=")


def test_c28_base64_with_or_without_padding(front_door):
    rng = np.random.default_rng(1)
    png = next(data for size in range(32, 48)
               if len(data := image_bytes("PNG", rng.integers(0, 256, (size, size, 3), dtype=np.uint8))) % 3)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _unpadded(png)}}
    assert_ok(*chat(front_door.url, image))
    wav = next(data for n in range(16000, 16012)
               if len(data := audio_bytes("WAV", np.zeros(n, np.float32), 16000)) % 3)
    audio = {"type": "input_audio", "input_audio": {"data": _unpadded(wav), "format": "wav"}}
    assert_ok(*chat(front_door.url, audio, text="What was said?"))
    for corrupt in ("data:image/png;base64," + _unpadded(png)[:-1], "data:image/png;base64,@@" + _unpadded(png)):
        status, body = chat(front_door.url, {"type": "image_url", "image_url": {"url": corrupt}})
        assert status == 400 and body["error"]["param"] == "messages[0].content[1]", body


def _check_offsets(logprobs: dict, text: str, start: int = 0) -> None:
    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
    assert offsets == [start + len("".join(tokens[:i])) for i in range(len(tokens))]
    assert "".join(tokens) == text[start:]


def test_c29_echo_with_prompt_logprobs(front_door):
    prompt = "correct horse battery staple"
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 5, "temperature": 0}
    status, _, answer = post(front_door.url + "/v1/completions", body)
    assert status == 200, answer
    choice, usage = answer["choices"][0], answer["usage"]
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(prompt)
    assert len(logprobs["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "".join(logprobs["tokens"][:usage["prompt_tokens"]]) == prompt  # the prompt's tokens come first
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
    _check_offsets(logprobs, choice["text"])
    # without echo: only the completion's tokens, offsets from 0; the completion is the same
    status, _, plain = post(front_door.url + "/v1/completions", {**body, "echo": False})
    assert plain["choices"][0]["text"] == choice["text"][len(prompt):]
    assert plain["choices"][0]["logprobs"]["tokens"] == logprobs["tokens"][usage["prompt_tokens"]:]
    # streamed: the first chunk is the prompt with its logprobs; the joined text is the same
    status, events = sse(front_door.url + "/v1/completions", {**body, "stream": True})
    chunks = [e for e in events if e != "[DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"] == prompt and first["logprobs"]["tokens"] == logprobs["tokens"][:usage["prompt_tokens"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    # max_tokens 0 (c01): the prompt alone, with its logprobs, nothing generated
    status, _, zero = post(front_door.url + "/v1/completions", {**body, "max_tokens": 0})
    assert zero["choices"][0]["text"] == prompt and zero["usage"]["completion_tokens"] == 0
    assert zero["choices"][0]["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][:usage["prompt_tokens"]]
