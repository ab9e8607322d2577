"""Fuzzing the front door with hypothesis: generated OpenAI request bodies never get a 500 or a hang.

Bodies for /v1/chat/completions, /v1/completions, /v1/audio/speech and /v1/images/generations mix valid and
invalid fields: wrong types, huge and negative numbers, NaN/Infinity, unicode, nested junk, missing fields;
raw bodies add non-JSON bytes, odd content types and deeply nested JSON. For every answer:

- the status is below 500 (a 500 is a fault; 503 would mean the stack fell over),
- it comes within CLIENT_TIMEOUT_S (else the request hung),
- a 4xx is a JSON OpenAI error object (`{"error": {"message", "type", "param", "code"}}`),
- a 200 is the endpoint's real answer (JSON completion, SSE ending in [DONE], audio, PNGs).

Whatever can become a real generation is kept short (max_tokens, n, steps and speech input are small when they
are valid), so the file runs in about two minutes. Runs are repeatable (`derandomize=True`). Afterwards a normal
greedy chat request must give its exact answer (`followed_by_a_normal_request`, tests/conftest.py).
"""

from __future__ import annotations

import base64
import io
import json
import math

import pytest
import requests
from front_door import MODEL
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.usefixtures("followed_by_a_normal_request")

CLIENT_TIMEOUT_S = 30
"""Seconds a single request may take before it counts as a hang."""

FUZZ = settings(max_examples=70, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])

# ---------------------------------------------------------------------------------------------------------
# Value strategies

SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-2**70, max_value=2**70), st.sampled_from([0, -1, 2**31, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.sampled_from(["", " ", "\u0000", "\ud7ff\ue000", "你好🌶️", "null", "1e9", "-3"]),
)
JUNK = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                    max_leaves=8)
"""Any JSON value (NaN and Infinity included, as Python's json writes and reads them)."""


def _small(limit: float):
    """A predicate: the value cannot be read as a number above `limit` (nor is it null, which means 'default'
    for the generation lengths). Pydantic reads "300" and 300.0 as ints, so strings and floats count too."""

    def check(value) -> bool:
        if value is None:
            return False
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            return True
        try:
            number = float(value)
        except (ValueError, OverflowError):
            return True
        return math.isnan(number) or number <= limit

    return check


def mixed(valid, limit: float | None = None):
    """Mostly `valid` values, sometimes junk; with `limit`, nothing that would be a valid value above it."""
    junk = JUNK if limit is None else JUNK.filter(_small(limit))
    return st.one_of(valid, valid, junk)


def fields(required: dict, optional: dict, keep: tuple[str, ...] = ()):
    """A body of `required` (one sometimes left out, never those in `keep`) and some of `optional`, plus the
    odd unknown field."""
    drop = st.sets(st.sampled_from(sorted(set(required) - set(keep))), max_size=1)

    def build(chosen, dropped, extra):
        body = {k: v for k, v in chosen.items() if k not in dropped}
        return {**extra, **body}

    return st.builds(build, st.fixed_dictionaries(required, optional=optional), st.one_of(st.just(set()), drop),
                     st.dictionaries(st.text(max_size=10), JUNK, max_size=1))


MODEL_NAMES = mixed(st.sampled_from([MODEL, MODEL, "does-not-exist", "tts-1"]))
SAMPLING = {
    "temperature": mixed(st.floats(0, 2)), "top_p": mixed(st.floats(0, 1)), "top_k": mixed(st.integers(-1, 50)),
    "min_p": mixed(st.floats(0, 1)), "seed": mixed(st.integers(0, 2**63)), "stream": mixed(st.booleans()),
    "stop": mixed(st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3))),
    "presence_penalty": mixed(st.floats(-3, 3)), "frequency_penalty": mixed(st.floats(-3, 3)),
    "repetition_penalty": mixed(st.floats(-1, 3)), "n": mixed(st.integers(1, 2), limit=2),
    "stream_options": mixed(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "ignore_eos": mixed(st.booleans()), "user": mixed(st.text(max_size=10)),
    "logit_bias": mixed(st.dictionaries(st.text(max_size=3), st.floats(-100, 100), max_size=2)),
}
MEDIA_PARTS = st.one_of(
    st.builds(lambda url: {"type": "image_url", "image_url": {"url": url}},
              st.one_of(st.text(max_size=30), st.just("data:image/png;base64,AAAA"),
                        st.builds(lambda b: "data:image/png;base64," + base64.b64encode(b).decode(),
                                  st.binary(max_size=64)))),
    st.builds(lambda data, fmt: {"type": "input_audio", "input_audio": {"data": data, "format": fmt}},
              st.one_of(st.text(max_size=20), st.builds(lambda b: base64.b64encode(b).decode(),
                                                        st.binary(max_size=64))), st.sampled_from(["wav", "mp3", "x"])),
    st.builds(lambda kind, value: {"type": kind, kind: value},
              st.sampled_from(["image_url", "input_audio", "text", "file", "video_url"]), JUNK),
)
CONTENT = mixed(st.one_of(
    st.text(max_size=40),
    st.lists(st.one_of(st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=20)), MEDIA_PARTS),
             max_size=3)))
MESSAGE = mixed(st.fixed_dictionaries(
    {"role": mixed(st.sampled_from(["user", "system", "assistant", "developer", "tool"])), "content": CONTENT},
    optional={"name": mixed(st.text(max_size=5))}))

CHAT = fields(
    {"model": MODEL_NAMES, "messages": mixed(st.lists(MESSAGE, max_size=3)),
     "max_tokens": mixed(st.integers(1, 4), limit=4)},
    {**SAMPLING, "max_completion_tokens": mixed(st.integers(1, 4), limit=4), "logprobs": mixed(st.booleans()),
     "top_logprobs": mixed(st.integers(0, 3)), "tools": JUNK, "tool_choice": JUNK, "response_format": JUNK,
     "modalities": mixed(st.lists(st.sampled_from(["text", "audio", "video"]), max_size=2)),
     "audio": mixed(st.fixed_dictionaries({"voice": st.sampled_from(["alloy", ""]),
                                           "format": st.sampled_from(["wav", "pcm16", "ogg"])}))},
    keep=("max_tokens",))  # without it a chat request generates up to the whole context
COMPLETION = fields(
    {"model": MODEL_NAMES, "max_tokens": mixed(st.integers(0, 4), limit=4),
     "prompt": mixed(st.one_of(st.text(max_size=40), st.lists(st.text(max_size=10), max_size=2),
                               st.lists(st.integers(-5, 60000), max_size=6),
                               st.lists(st.lists(st.integers(-5, 60000), max_size=4), max_size=2)))},
    {**SAMPLING, "echo": mixed(st.booleans()), "logprobs": mixed(st.integers(-1, 6)), "best_of": JUNK,
     "suffix": mixed(st.text(max_size=5))})
SPEECH = fields(
    {"model": MODEL_NAMES, "input": mixed(st.text(max_size=30), limit=0),
     "voice": mixed(st.sampled_from(["alloy", "joe", "nova", "", "x"]))},
    {"response_format": mixed(st.sampled_from(["wav", "pcm", "flac", "mp3", "opus", "aac", ""])),
     "speed": mixed(st.floats(0.1, 5)), "instructions": JUNK, "stream_format": JUNK})
IMAGES = fields(
    {"model": MODEL_NAMES, "prompt": mixed(st.text(max_size=30), limit=0), "steps": mixed(st.integers(1, 2), limit=2)},
    {"n": mixed(st.integers(1, 2), limit=2), "size": mixed(st.sampled_from(["64x64", "128x128", "1x1", "64", ""])),
     "seed": mixed(st.integers(-2, 2**64)),
     "guidance_scale": mixed(st.floats(-1, 25)), "negative_prompt": mixed(st.text(max_size=10)),
     "response_format": mixed(st.sampled_from(["b64_json", "url", ""])), "quality": JUNK, "style": JUNK},
    keep=("steps",))  # the default is 10 denoising steps

# ---------------------------------------------------------------------------------------------------------
# Sending and checking


def send(url: str, data: bytes, content_type: str | None) -> requests.Response:
    """POST raw bytes; a request that takes longer than CLIENT_TIMEOUT_S fails the test as a hang."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    try:
        return requests.post(url, data=data, headers=headers, timeout=CLIENT_TIMEOUT_S)
    except requests.Timeout:
        pytest.fail(f"no answer within {CLIENT_TIMEOUT_S} s (a hang) for {url} {data[:300]!r}")


def check_answer(response: requests.Response, path: str, sent) -> None:
    """The status is < 500, a 4xx is an OpenAI error object, a 200 is the endpoint's kind of answer."""
    where = f"{path} {sent!r:.400}"
    assert response.status_code < 500, f"{response.status_code} {response.text[:400]} for {where}"
    content_type = response.headers.get("content-type", "")
    if response.status_code >= 400:
        assert content_type.startswith("application/json"), f"{content_type} {response.text[:200]} for {where}"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, f"{error} for {where}"
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), where
        assert error["param"] is None or isinstance(error["param"], str), where
        return
    assert response.status_code == 200, f"{response.status_code} for {where}"
    if content_type.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"{events[-3:]} for {where}"
        for event in events[:-1]:
            payload = json.loads(event)
            assert "error" not in payload or payload["error"]["type"] != "server_error", f"{payload} for {where}"
    elif path == "/v1/audio/speech":
        audio = response.content
        assert content_type.startswith("audio/"), f"{content_type} for {where}"
        if content_type in ("audio/wav", "audio/mpeg", "audio/flac"):  # files: decodable (pcm may be empty)
            import soundfile

            soundfile.read(io.BytesIO(audio))
    else:
        body = response.json()
        if path == "/v1/images/generations":
            assert body["data"] and all(base64.b64decode(d["b64_json"])[:4] == b"\x89PNG" for d in body["data"])
        else:
            assert body["choices"] and body["usage"]["total_tokens"] >= body["usage"]["prompt_tokens"], where


def post_body(front_door, path: str, body) -> None:
    """Send `body` as JSON (NaN/Infinity written as Python's json writes them) and check the answer."""
    data = json.dumps(body).encode("utf-8", errors="surrogatepass")
    check_answer(send(front_door.url + path, data, "application/json"), path, body)


# ---------------------------------------------------------------------------------------------------------
# The fuzz tests


@FUZZ
@given(body=CHAT)
@example(body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_k": 2**64})
def test_chat_completions_fuzz(front_door, body):
    post_body(front_door, "/v1/chat/completions", body)


@FUZZ
@given(body=COMPLETION)
@example(body={"model": MODEL, "prompt": [5, 2**70], "max_tokens": 1})
def test_completions_fuzz(front_door, body):
    post_body(front_door, "/v1/completions", body)


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/chat/completions", {"top_k": 2**64}, "top_k"),  # found by the fuzzer: was a 500 (OverflowError)
    ("/v1/chat/completions", {"max_tokens": 2**32 + 2}, "max_tokens"),  # numpy would wrap it to 2
    ("/v1/completions", {"max_tokens": 2**32 + 2}, "max_tokens"),
    ("/v1/completions", {"prompt": [5, 2**40]}, "prompt"),
    ("/v1/chat/completions", {"repetition_penalty": 1e39}, "repetition_penalty"),  # inf in float32
])
def test_values_beyond_the_tensor_types_are_400_naming_the_field(front_door, path, fields, param):
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if path.endswith("chat/completions") else {"prompt": "hi"}
    body = {"model": MODEL, "max_tokens": 2, **prompt, **fields}
    response = send(front_door.url + path, json.dumps(body).encode(), "application/json")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error


@FUZZ
@given(body=SPEECH)
@example(body={"model": MODEL, "input": "\ud7b0", "voice": "alloy"})  # nothing to speak: was an empty "mp3"
def test_audio_speech_fuzz(front_door, body):
    post_body(front_door, "/v1/audio/speech", body)


@FUZZ
@given(body=IMAGES)
def test_images_generations_fuzz(front_door, body):
    post_body(front_door, "/v1/images/generations", body)


CONTENT_TYPES = st.sampled_from([None, "application/json", "application/json; charset=utf-8", "text/plain",
                                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                 "application/vnd.api+json", "APPLICATION/JSON", "application/json; charset=latin-1",
                                 "", "*/*", "application/octet-stream"])
RAW = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=100).map(lambda t: t.encode("utf-8")),
    JUNK.map(lambda v: json.dumps(v).encode()),
    st.builds(lambda depth, open_: (open_ * depth).encode(), st.integers(1, 100_000), st.sampled_from(["[", '{"a":'])),
)
PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/audio/speech", "/v1/images/generations"])


@FUZZ
@given(path=PATHS, data=RAW, content_type=CONTENT_TYPES)
@example(path="/v1/chat/completions", data=b"[" * 100_000 + b"]" * 100_000, content_type="application/json")
@example(path="/v1/completions", data=b'{"model": "omni_chat", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
         content_type="application/json")
def test_raw_bodies_and_content_types_fuzz(front_door, path, data, content_type):
    check_answer(send(front_door.url + path, data, content_type), path, data)
