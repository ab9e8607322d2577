"""The request vocabulary (omni_backend/vocabulary.py): every field maps to exactly one SamplingParams attribute,
one Triton tensor of the right type in the model configs, and SamplingParams' range; error kinds round-trip."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from omni_backend.engine.sampling_params import RANGES, SamplingParams
from omni_backend.serving import protocol
from omni_backend.vocabulary import (BY_PARAM, BY_TENSOR, DATATYPE_RANGES, PROMPT_TENSORS, SAMPLING_FIELDS,
                                     ErrorKind, FieldError, StageError, openai_param, tensor_value_problem)

REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
# SamplingParams attributes no request sets: the engine's own stop ids, and what the talker's requests and the
# thinker's requests for a spoken answer set (stages/talker.py)
INTERNAL_PARAMS = {"stop_token_ids", "suppress_token_ids", "return_hidden_states"}


def config_inputs(model: str) -> dict[str, tuple[str, bool]]:
    """A model's inputs in its config.pbtxt template: name -> (Triton datatype, optional)."""
    text = (REPOSITORY / model / "config.pbtxt").read_text()
    block = text[text.index("input ["):text.index("output [")]
    inputs = {}
    for line in re.findall(r"\{[^}]*name: \"[^\"]+\"[^}]*\}", block):
        name = re.search(r'name: "([^"]+)"', line).group(1)
        datatype = re.search(r"data_type: TYPE_(\w+)", line).group(1).replace("STRING", "BYTES")
        inputs[name] = (datatype, "optional: true" in line)
    return inputs


def test_every_field_maps_to_exactly_one_attribute_tensor_and_range():
    params = [f.param for f in SAMPLING_FIELDS]
    tensors = [f.tensor for f in SAMPLING_FIELDS]
    openai = [name for f in SAMPLING_FIELDS for name in f.openai]
    assert len(set(params)) == len(params) and len(set(tensors)) == len(tensors) and len(set(openai)) == len(openai)
    attributes = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(params) == attributes - INTERNAL_PARAMS  # every request-settable attribute, none invented
    assert not set(tensors) & set(PROMPT_TENSORS)
    for field in SAMPLING_FIELDS:
        assert BY_PARAM[field.param] is field and BY_TENSOR[field.tensor] is field
        assert field.range is RANGES.get(field.param)  # SamplingParams' own range object, not a copy
        if field.range is not None:
            assert field.datatype in DATATYPE_RANGES
            assert field.range.integer == DATATYPE_RANGES[field.datatype].integer, field
        else:
            assert field.datatype in ("BOOL", "BYTES"), field
    assert set(RANGES) <= set(params)  # every numeric attribute is a request field


@pytest.mark.parametrize("model", ["omni_chat", "omni_chat_mm", "omni_speech", "preprocess"])
def test_the_model_configs_declare_the_vocabulary(model):
    """The ensembles' and preprocess's inputs are the vocabulary's tensors with its datatypes, all optional but
    the prompt (and the ensembles' max_tokens, see omni_chat/config.pbtxt): a tensor renamed or retyped in one
    place only fails here."""
    inputs = config_inputs(model)
    # speech answers carry no logprobs and are not constrained
    absent = {"omni_speech": {"logprobs", "prompt_logprobs", "guided_decoding_guide_type",
                              "guided_decoding_guide"}}.get(model, set())
    for field in SAMPLING_FIELDS:
        if field.tensor not in absent:
            optional = model == "preprocess" or field.tensor != "max_tokens"
            assert inputs[field.tensor] == (field.datatype, optional), (model, field)
    assert inputs["text_input"] == (PROMPT_TENSORS["text_input"], False)
    known = {f.tensor for f in SAMPLING_FIELDS} | set(PROMPT_TENSORS)
    extra = {"omni_speech": {"voice", "audio_format", "speed"},
             "preprocess": {"add_generation_prompt", "continue_final_message", "prompt_is_text", "tools"}}
    extra = extra.get(model, set())
    assert set(inputs) - known == extra


def test_the_openai_request_models_take_their_bounds_from_the_vocabulary():
    """Each OpenAI setting's bounds in the chat request's JSON schema (what pydantic checks and /openapi.json
    publishes) are SamplingParams' range narrowed to what its tensor holds (chat; completions narrow `logprobs` to
    the legacy API's 5 and allow `max_tokens` 0, tested with the cases)."""
    checked = set()
    for name, schema in protocol.ChatCompletionRequest.model_json_schema()["properties"].items():
        setting = next((f for f in SAMPLING_FIELDS if name in f.openai), None)
        if setting is None or setting.range is None or name == "logprobs":  # chat's logprobs: on/off
            continue
        checked.add(name)
        value, allowed = schema["anyOf"][0], setting.allowed
        assert value["exclusiveMinimum" if allowed.low_open else "minimum"] == allowed.low, name
        holds = DATATYPE_RANGES[setting.datatype].high
        assert value["maximum"] == allowed.high == min(h for h in (setting.range.high, holds) if h is not None), name
    assert checked >= {"temperature", "top_p", "top_k", "seed", "max_tokens", "top_logprobs", "repetition_penalty"}


def test_an_open_bound_at_zero_is_the_smallest_positive_value_the_tensor_holds():
    """top_p is (0, 1]: 1e-46 > 0 would be stored as 0 in its FP32 tensor, so the client may send from 2**-149 (the
    least FP32 subnormal) on."""
    top_p = BY_PARAM["top_p"]
    assert (top_p.range.low, top_p.range.low_open) == (0.0, True)
    assert (top_p.allowed.low, top_p.allowed.low_open) == (2.0**-149, False)
    assert np.float32(top_p.allowed.low) > 0 and np.float32(2.0**-150) == 0
    assert top_p.problem(1e-46) is not None and top_p.problem(2.0**-149) is None


def test_defaults_are_sampling_params_defaults_except_max_tokens():
    defaults = SamplingParams()
    for field in SAMPLING_FIELDS:
        expected = None if field.param == "max_tokens" else getattr(defaults, field.param)
        assert field.default == expected, field


@pytest.mark.parametrize("datatype, value, ok", [
    ("INT32", 2**31 - 1, True), ("INT32", 2**31, False), ("INT32", 4294967304, False), ("INT32", True, False),
    ("INT32", 3.0, False), ("INT32", "3", False), ("UINT64", -1, False), ("UINT64", 2**64 - 1, True),
    ("FP32", 1, True), ("FP32", 1e39, False), ("FP32", float("nan"), False), ("FP32", "0.1", False),
    ("BOOL", True, True), ("BOOL", "yes", False), ("BOOL", 1, False), ("BYTES", "hi", True), ("BYTES", 123, False),
])
def test_tensor_values_are_checked_without_narrowing(datatype, value, ok):
    assert (tensor_value_problem(datatype, value) is None) == ok


def test_stage_errors_cross_as_a_header():
    error = StageError.of(FieldError("random_seed", "must be an integer in [0, 9223372036854775807], got -1"), "x")
    wire = error.wire()
    assert wire == ("[invalid_argument field=random_seed] random_seed must be an integer in "
                    "[0, 9223372036854775807], got -1")
    back = StageError.parse("in ensemble 'omni_chat', " + wire)
    assert (back.kind, back.field, back.message) == (ErrorKind.INVALID_ARGUMENT, "random_seed", error.message)
    hot = StageError.parse(StageError(ErrorKind.NOT_ADMITTING, "too hot", retry_after_s=10).wire())
    assert (hot.kind, hot.retry_after_s, hot.message) == (ErrorKind.NOT_ADMITTING, 10, "too hot")
    fault = StageError.of(RuntimeError("boom"), "llm")
    assert (fault.kind, fault.message) == (ErrorKind.INTERNAL, "llm failed: RuntimeError: boom")
    assert StageError.parse("Stub process 'llm_0_0' is not healthy.") is None  # Triton's own words
    assert StageError.parse("[no_such_kind] x") is None
    assert {kind.code for kind in ErrorKind} == {kind.code for kind in ErrorKind if kind.http_status in
                                                 (400, 429, 500, 503)}


def test_stage_fields_are_named_as_the_client_knows_them():
    assert openai_param("random_seed", "prompt") == "seed"
    assert openai_param("stop_words", "prompt") == "stop"
    assert openai_param("text_input", "messages") == "messages"
    assert openai_param("text_input[0].content[1]", "messages") == "messages[0].content[1]"
    assert openai_param("prompt_token_ids[3]", "prompt") == "prompt[3]"
    assert openai_param("voice", "prompt") == "voice"  # not a generation field: as it is
