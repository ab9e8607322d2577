"""Fuzzing the front door with hypothesis: generated OpenAI request bodies never get a 500 or a hang.

Bodies for /v1/chat/completions, /v1/completions, /v1/audio/speech and /v1/images/generations are all valid
(half of them, so real generations run with odd but legal settings, unicode and `null` for the fields OpenAI
marks nullable), have one bad field, or are mostly junk: wrong types (strings where numbers or booleans belong),
out-of-range, huge and negative numbers, NaN/Infinity, unicode, nested junk, missing and unknown fields. Raw
bodies add non-JSON bytes, odd content types, deeply nested JSON and content codings (gzip, deflate, mislabelled,
unknown); Triton's `/v2/models/omni_chat/generate` through the front door gets bodies of every input with values
of the wrong type or range. For every answer:

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
import gzip
import io
import json
import math
import zlib
from dataclasses import dataclass

import pytest
import requests
from helpers.front_door import MODEL
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from omni_backend.setup.tiny_multimodal import IMAGE_TOKENS

pytestmark = [
    pytest.mark.usefixtures("followed_by_a_normal_request"),
    # numpy only warns when it wraps an out-of-range integer into a tensor's type (the front door runs in this
    # process, so the warning becomes an exception there and the test sees a 500)
    pytest.mark.filterwarnings("error:NumPy will stop allowing conversion of out-of-bound:DeprecationWarning"),
]

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
    for the generation lengths). Types are strict ("300" and 300.0 are no integers), but junk is kept away from
    anything a future lenient reading could turn into a long generation."""

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


@dataclass(frozen=True)
class Field:
    """How to draw one request field: a `valid` value, or a `bad` one (near misses and junk)."""

    valid: st.SearchStrategy
    bad: st.SearchStrategy


def field(valid, *near_misses, limit: float | None = None) -> Field:
    """A field whose bad values are the `near_misses` (out of range, wrong choice) or any JSON junk; with
    `limit`, no junk that a lenient schema could read as a valid value above it (e.g. "300" for max_tokens)."""
    junk = JUNK if limit is None else JUNK.filter(_small(limit))
    return Field(valid, st.one_of(*near_misses, junk))


@st.composite
def bodies(draw, required: dict[str, Field], optional: dict[str, Field], keep: tuple[str, ...] = ()):
    """A request body of the `required` fields and up to 4 `optional` ones, in one of three modes: all valid
    (so real generations run), one bad field (or a required one missing), or about half bad plus unknown
    fields. Fields in `keep` are never left out."""
    mode = draw(st.sampled_from(["valid", "valid", "one_bad", "junk"]))
    names = list(required) + draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=4))
    specs = {**required, **optional}
    bad: set[str] = set()
    if mode == "one_bad":
        bad = {draw(st.sampled_from(names))}
    elif mode == "junk":
        bad = {name for name in names if draw(st.booleans())}
    body = draw(st.dictionaries(st.text(max_size=10), JUNK, max_size=2)) if mode == "junk" else {}
    for name in names:
        if name in bad and name in required and name not in keep and draw(st.booleans()):
            body.pop(name, None)  # left out
            continue
        body[name] = draw(specs[name].bad if name in bad else specs[name].valid)
    return body


def text(min_size: int = 1, max_size: int = 30):
    return st.text(min_size=min_size, max_size=max_size)


NAN_FREE = {"allow_nan": False, "allow_infinity": False}
MODEL_FIELD = field(st.just(MODEL), st.just("does-not-exist"))
WRONG_TYPES = st.sampled_from(["yes", "1", "0.5", "true", 1, 0, 1.0, [], {}])


def nullable(strategy):
    """A valid value of a field OpenAI marks nullable: `strategy`'s, or null (the default)."""
    return st.one_of(st.none(), strategy)


SAMPLING = {
    "temperature": field(nullable(st.floats(0, 2)), st.floats(2.01, 1e6), st.floats(max_value=-0.01, **NAN_FREE)),
    "top_p": field(nullable(st.floats(0.01, 1)), st.just(0), st.floats(1.01, 1e6)),
    "top_k": field(nullable(st.integers(-1, 50)), st.integers(max_value=-2), st.integers(min_value=2**31)),
    "min_p": field(nullable(st.floats(0, 1)), st.floats(1.01, 1e6)),
    "seed": field(nullable(st.integers(0, 2**63 - 1)), st.integers(max_value=-1), st.integers(min_value=2**63)),
    "stream": field(nullable(st.booleans()), WRONG_TYPES),
    "stop": field(nullable(st.one_of(text(1, 5), st.lists(text(1, 5), max_size=3))), st.just(""), st.just([""])),
    "presence_penalty": field(nullable(st.floats(-2, 2)), st.floats(2.01, 1e9)),
    "frequency_penalty": field(nullable(st.floats(-2, 2)), st.floats(max_value=-2.01, **NAN_FREE)),
    "repetition_penalty": field(nullable(st.floats(0.5, 2)), st.floats(max_value=0, **NAN_FREE)),
    "n": field(nullable(st.integers(1, 2)), st.integers(max_value=0), st.integers(129, 10**6), limit=2),
    "stream_options": field(nullable(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}))),
    "ignore_eos": field(st.booleans(), WRONG_TYPES),
    "user": field(nullable(text(0, 10))),
    "logit_bias": field(nullable(st.just({})), st.dictionaries(text(1, 3), st.floats(-100, 100), min_size=1,
                                                                max_size=2)),
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
TEXT_PART = st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=20))
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]),
     "content": st.one_of(st.text(max_size=40), st.lists(TEXT_PART, min_size=1, max_size=3))},
    optional={"name": text(1, 5)})
BAD_MESSAGE = st.one_of(JUNK, st.fixed_dictionaries(
    {"role": st.one_of(JUNK, st.sampled_from(["tool", "wizard"])),
     "content": st.one_of(JUNK, st.lists(st.one_of(TEXT_PART, MEDIA_PARTS), max_size=3))}))
MAX_TOKENS = field(st.integers(1, 4), st.integers(max_value=0), st.integers(min_value=2**31), limit=4)

CHAT = bodies(
    {"model": MODEL_FIELD, "messages": field(st.lists(MESSAGE, min_size=1, max_size=3), st.just([]),
                                             st.lists(BAD_MESSAGE, min_size=1, max_size=2)),
     "max_tokens": MAX_TOKENS},
    {**SAMPLING, "max_completion_tokens": MAX_TOKENS, "logprobs": field(nullable(st.booleans()), WRONG_TYPES),
     "top_logprobs": field(nullable(st.integers(0, 3)), st.integers(21, 10**6), st.integers(max_value=-1)),
     "tools": field(st.just([]), st.lists(JUNK, min_size=1, max_size=2)),
     "tool_choice": field(st.sampled_from([None, "none", "auto"]), st.just("required")),
     "response_format": field(st.sampled_from([{"type": "text"}, {"type": "json_object"}]), st.just({"type": "xml"})),
     "modalities": field(st.just(["text"]), st.sampled_from([["text", "audio"], ["video"], []])),
     "audio": field(st.none(), st.fixed_dictionaries({"voice": st.sampled_from(["alloy", ""]),
                                                      "format": st.sampled_from(["wav", "pcm16", "ogg"])}))},
    keep=("max_tokens",))  # without it a chat request generates up to the whole context
VOCAB = 49152 + len(IMAGE_TOKENS)  # the default model's tokenizer: SmolLM2's and SmolVLM's added image tokens
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
COMPLETION = bodies(
    {"model": MODEL_FIELD,
     "max_tokens": field(st.integers(0, 4), st.integers(max_value=-1), st.integers(min_value=2**31), limit=4),
     "prompt": field(st.one_of(text(1, 40), st.lists(text(1, 10), min_size=1, max_size=2), TOKEN_IDS,
                               st.lists(TOKEN_IDS, min_size=1, max_size=2)),
                     st.sampled_from(["", [], [[]], [""]]), st.lists(st.integers(VOCAB, 2**40), min_size=1, max_size=2),
                     st.lists(st.integers(max_value=-1), min_size=1, max_size=2))},
    {**SAMPLING, "echo": field(nullable(st.booleans()), WRONG_TYPES),
     "logprobs": field(nullable(st.integers(0, 5)), st.integers(6, 10**6), st.integers(max_value=-1)),
     "best_of": field(st.none(), st.integers(2, 5)), "suffix": field(st.sampled_from([None, ""]), text(1, 5))})
SPEECH = bodies(
    {"model": field(st.sampled_from([MODEL, "tts-1"]), st.just("does-not-exist")),
     "input": field(text(1, 30), st.sampled_from(["", "   "]), st.text(min_size=4097, max_size=4100), limit=0),
     "voice": field(st.sampled_from(["alloy", "joe", "nova"]), st.sampled_from(["", "x"]))},
    {"response_format": field(st.sampled_from(["wav", "pcm", "flac", "mp3"]), st.sampled_from(["opus", "aac", "ogg", ""])),
     "speed": field(st.floats(0.25, 4), st.floats(max_value=0.24, **NAN_FREE), st.floats(4.01, 1e9)),
     "instructions": field(text(0, 10)), "stream_format": field(st.just("audio"), st.just("sse"))})
IMAGES = bodies(
    {"model": MODEL_FIELD, "prompt": field(text(1, 30), st.sampled_from(["", " "]), limit=0),
     "steps": field(st.integers(1, 2), st.integers(max_value=0), st.integers(51, 10**9), limit=2)},
    {"n": field(st.integers(1, 2), st.integers(max_value=0), st.integers(11, 10**6), limit=2),
     "size": field(st.just("64x64"), st.sampled_from(["1x1", "64", "", "100000x10000", "64x64x64"])),
     "seed": field(st.integers(0, 2**32), st.integers(max_value=-1), st.integers(min_value=2**64)),
     "guidance_scale": field(st.floats(0, 20), st.floats(20.01, 1e9), st.floats(max_value=-0.01, **NAN_FREE)),
     "negative_prompt": field(text(0, 10)), "response_format": field(st.just("b64_json"), st.sampled_from(["url", ""])),
     "quality": field(st.none()), "style": field(st.none())},
    keep=("steps",))  # the default is 10 denoising steps

# ---------------------------------------------------------------------------------------------------------
# Sending and checking


def send(url: str, data: bytes, content_type: str | None, **extra_headers) -> requests.Response:
    """POST raw bytes; a request that takes longer than CLIENT_TIMEOUT_S fails the test as a hang."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    headers.update(extra_headers)
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
    ("/v1/images/generations", {"steps": -3189618024251821}, "steps"),  # found by the fuzzer: wrapped to int32
    ("/v1/images/generations", {"guidance_scale": 1e39}, "guidance_scale"),
])
def test_values_beyond_the_tensor_types_are_400_naming_the_field(front_door, path, fields, param):
    if path.endswith("chat/completions"):
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **fields}
    elif path.endswith("/completions"):
        body = {"model": MODEL, "max_tokens": 2, "prompt": "hi", **fields}
    else:
        body = {"model": MODEL, "prompt": "a cat", "size": "64x64", "steps": 1, **fields}
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


CODINGS = st.sampled_from(["gzip", "deflate", "identity", "br", "gzip, deflate", "", "GZIP", "x-gzip"])
ENCODERS = {"gzip": gzip.compress, "deflate": zlib.compress, "raw": lambda d: d,
            "truncated": lambda d: gzip.compress(d)[: max(1, len(gzip.compress(d)) // 2)]}


@FUZZ
@given(path=PATHS, body=st.one_of(CHAT, COMPLETION, RAW.map(lambda d: d)), coding=CODINGS,
       encoder=st.sampled_from(sorted(ENCODERS)))
@example(path="/v1/chat/completions", body=b"{}", coding="gzip", encoder="raw")  # a plain body labelled gzip
def test_content_codings_fuzz(front_door, path, body, coding, encoder):
    """Bodies compressed as labelled, compressed otherwise, mislabelled or truncated: never a 500 or a hang."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8", errors="surrogatepass")
    response = send(front_door.url + path, ENCODERS[encoder](data), "application/json", **{"Content-Encoding": coding})
    check_answer(response, path, (coding, encoder, data[:200]))


GENERATE = bodies(
    {"text_input": field(text(1, 30), st.sampled_from(["", "[", "[]", '[{"role": "user"}]']), st.integers()),
     "max_tokens": field(st.integers(1, 4), st.integers(max_value=0), st.integers(min_value=2**31),
                         st.sampled_from(["abc", 3.5, True, None, "4"]), limit=4)},
    {"temperature": field(st.floats(0, 2), st.sampled_from(["0.1", None, True]), st.floats(2.01, 1e40)),
     "top_k": field(st.integers(-1, 50), st.integers(min_value=2**31), st.just(1.5)),
     "random_seed": field(st.integers(0, 2**63 - 1), st.integers(max_value=-1), st.integers(min_value=2**64)),
     "stop_words": field(st.lists(text(1, 5), max_size=2), st.lists(st.integers(), min_size=1, max_size=2)),
     "stream": field(st.just(False), WRONG_TYPES, st.just(True)), "ignore_eos": field(st.booleans(), WRONG_TYPES),
     "logprobs": field(st.integers(0, 2), st.integers(21, 2**40)),
     "prompt_logprobs": field(st.integers(0, 2), st.integers(max_value=-1))},
    keep=("max_tokens",))  # without it preprocess would generate up to the whole context


@settings(FUZZ, max_examples=40)
@given(body=GENERATE)
@example(body={"text_input": "Once upon a time", "max_tokens": 4294967304})  # c21: Triton alone serves 8 tokens
@example(body={"text_input": 123, "max_tokens": "abc", "random_seed": -1})  # c22: Triton alone answers 500
def test_triton_generate_through_the_front_door_fuzz(front_door, body):
    """/v2/models/omni_chat/generate: typed before Triton parses it, so never a 500 (Triton's own parser
    answers wrong types with 500 "Unable to parse 'data'"), and a 4xx keeps Triton's {"error": str} shape."""
    path = f"/v2/models/{MODEL}/generate"
    data = json.dumps(body).encode("utf-8", errors="surrogatepass")
    response = send(front_door.url + path, data, "application/json")
    where = f"{path} {body!r:.300}"
    assert response.status_code < 500, f"{response.status_code} {response.text[:300]} for {where}"
    answer = response.json()
    if response.status_code >= 400:
        assert set(answer) == {"error"} and isinstance(answer["error"], str) and answer["error"], where
    else:
        assert isinstance(answer["text_output"], str) and answer["completion_tokens"] >= 0, where
