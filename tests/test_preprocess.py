"""Preprocess stage logic without a server: prompts, chat messages, settings and every bad input."""

import json

import numpy as np
import pytest

from omni_backend.engine.limits import ContextLengthExceeded
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.setup import smollm2
from omni_backend.stages.preprocess import Preprocessor, parse_messages
from omni_backend.vocabulary import ErrorKind, FieldError, StageError

MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def preprocessor():
    return Preprocessor.from_pretrained(str(smollm2.checkpoint_dir()), MAX_MODEL_LEN)


def request(text, max_tokens=16, **extra):
    arrays = {"max_tokens": np.array([max_tokens], dtype=np.int32)}
    if text is not None:
        arrays["text_input"] = np.array([text if isinstance(text, bytes) else text.encode()], dtype=np.object_)
    types = {"temperature": np.float32, "top_p": np.float32, "top_k": np.int32, "random_seed": np.uint64,
             "stream": np.bool_, "logprobs": np.int32, "ignore_eos": np.bool_, "min_p": np.float32,
             "repetition_penalty": np.float32, "presence_penalty": np.float32, "frequency_penalty": np.float32}
    for name, value in extra.items():
        if name == "stop_words":
            arrays[name] = np.array([s.encode() for s in value], dtype=np.object_)
        else:
            arrays[name] = np.array([value], dtype=types[name])
    return arrays


def test_plain_text_is_tokenized_as_is(preprocessor):
    out = preprocessor.run(request("Hello world"))
    assert out["input_ids"].dtype == np.int32
    assert out["input_ids"].tolist() == preprocessor.tokenizer("Hello world").input_ids
    assert out["sampling_params"].shape == (1,)


def test_messages_use_the_chat_template(preprocessor):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = preprocessor.run(request(json.dumps(messages)))
    text = preprocessor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert out["input_ids"].tolist() == preprocessor.tokenizer(text, add_special_tokens=False).input_ids


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert parse_messages(json.dumps([{"role": "user", "content": parts}])) == [
        {"role": "user", "content": "first\nsecond"}
    ]


def test_settings_become_sampling_params(preprocessor):
    out = preprocessor.run(request("Hi", max_tokens=5, temperature=0.5, top_p=0.9, top_k=40, random_seed=123,
                                   stream=True, logprobs=3, stop_words=["\n\n", "END"], ignore_eos=True))
    params = SamplingParams.from_json(out["sampling_params"][0].decode())
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (5, 0.5, 40, 123)
    assert params.top_p == pytest.approx(0.9)
    assert params.stream and params.ignore_eos and params.logprobs == 3
    assert params.stop == ["\n\n", "END"]


def test_defaults_when_optional_inputs_are_absent(preprocessor):
    params = SamplingParams.from_json(preprocessor.run(request("Hi"))["sampling_params"][0].decode())
    assert params == SamplingParams(max_tokens=16)
    arrays = request("Hi")
    del arrays["max_tokens"]  # absent: the rest of the context, filled here (the front door sends none)
    out = preprocessor.run(arrays)
    params = SamplingParams.from_json(out["sampling_params"][0].decode())
    assert params == SamplingParams(max_tokens=MAX_MODEL_LEN - out["input_ids"].size)


@pytest.mark.parametrize(
    "arrays, fragment",
    [
        (request(None), "text_input is required"),
        (request(""), "text_input is empty"),
        (request("Hi", max_tokens=0), "max_tokens must be an integer in [1, inf), got 0"),
        (request("Hi", max_tokens=-3), "max_tokens must be an integer in [1, inf), got -3"),
        (request("Hi", max_tokens=MAX_MODEL_LEN + 1), f"max_tokens must be at most {MAX_MODEL_LEN}"),
        (request('[{"role": "user", "content": "Hi"'), "not a valid messages JSON array"),
        (request("[]"), "non-empty JSON array"),
        (request('[{"role": "user"}]'), "text_input[0].content"),
        (request('[{"content": "Hi"}]'), "text_input[0].role"),
        (request('[{"role": "user", "content": [{"type": "image_url"}]}]'), "text_input[0].content[0]"),
        (request(b"\xff\xfe bad"), "text_input is not valid UTF-8"),
        (request("Hi", temperature=3.0), "temperature"),
        (request("Hi", top_p=0.0), "top_p"),
        (request("Hi", random_seed=2**64 - 1), "random_seed"),
        (request("Hi", stop_words=[""]), "stop_words"),
        (request("Hi", logprobs=50), "logprobs"),
        (request("word " * 2000, max_tokens=100), "maximum context length is 2048 tokens"),
    ],
)
def test_bad_input_raises_value_error_naming_it(preprocessor, arrays, fragment):
    with pytest.raises((ValueError, StageError)) as excinfo:
        preprocessor.run(arrays)
    assert fragment in str(excinfo.value)
    if isinstance(excinfo.value, FieldError):  # the field it names is data, not only words
        assert str(excinfo.value).startswith(excinfo.value.field + " ")


def test_context_length_message_counts_tokens(preprocessor):
    prompt_tokens = len(preprocessor.tokenizer("word " * 2000).input_ids)
    with pytest.raises(ContextLengthExceeded) as excinfo:
        preprocessor.run(request("word " * 2000, max_tokens=100))
    assert StageError.of(excinfo.value, "preprocess").kind is ErrorKind.CONTEXT_LENGTH_EXCEEDED
    assert str(excinfo.value) == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens, you requested {prompt_tokens + 100} tokens "
        f"({prompt_tokens} in the prompt, 100 for the completion)"
    )
