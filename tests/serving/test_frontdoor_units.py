"""Front door pieces without a server: request validation, error classification, settings, token-id prompts."""

import json

import numpy as np
import pytest

from omni_backend.serving import errors, protocol
from omni_backend.serving.config import ServingConfig
from omni_backend.stages.llm.service import QueueFull
from omni_backend.vocabulary import ErrorKind, FieldError, StageError


def test_schema_errors_name_the_field():
    cases = [
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "x"}]},
         "messages[1].role"),
        ({"messages": []}, "model"),
        ({"model": "m"}, "messages"),
    ]
    for body, param in cases:
        with pytest.raises(errors.OpenAIError) as excinfo:
            protocol.parse_request(protocol.ChatCompletionRequest, body)
        assert excinfo.value.status == 400 and excinfo.value.param == param
        assert param in excinfo.value.message


def test_completion_prompts_and_limits():
    request = protocol.parse_request(protocol.CompletionRequest, {"model": "m", "prompt": [1, 2, 3]})
    assert [p.token_ids for p in request.prompts()] == [[1, 2, 3]] and request.max_tokens == 16
    request = protocol.parse_request(protocol.CompletionRequest, {"model": "m", "prompt": ["a", "b"]})
    assert [p.text for p in request.prompts()] == ["a", "b"]
    with pytest.raises(errors.OpenAIError) as excinfo:
        protocol.parse_request(protocol.CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 6})
    assert excinfo.value.param == "logprobs"


def test_chat_request_becomes_a_generation_request():
    request = protocol.parse_request(protocol.ChatCompletionRequest, {
        "model": "m", "max_completion_tokens": 5, "max_tokens": 9, "seed": 3, "stop": "END", "top_k": 4,
        "messages": [{"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert request.messages_json() == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}]
    generation = request.generation()
    # settings by vocabulary name (SamplingParams attributes); max_completion_tokens wins over max_tokens
    assert generation.settings == {"max_tokens": 5, "seed": 3, "top_k": 4, "stop": ["END"], "stream": False}
    assert json.loads(generation.prompts[0].text) == request.messages_json()
    assert [generation.choice_settings(i)["seed"] for i in range(2)] == [3, 3]  # n = 1: no offset
    no_limit = protocol.parse_request(protocol.ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": "hi"}]}).generation()
    assert "max_tokens" not in no_limit.settings  # preprocess takes the rest of the context


def test_ranges_come_from_sampling_params_narrowed_to_the_tensor_type():
    """The OpenAI models take their bounds from SamplingParams' RANGES (through the vocabulary) and from the
    Triton type: top_k has no upper bound in SamplingParams, INT32 has one."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for field, value in (("temperature", 2.0), ("top_p", 1.0), ("top_k", 2**31 - 1), ("seed", 2**63 - 1),
                         ("presence_penalty", -2), ("top_logprobs", 20)):
        extra = {"logprobs": True} if field == "top_logprobs" else {}
        protocol.parse_request(protocol.ChatCompletionRequest, {**chat, **extra, field: value})
    for field, value in (("temperature", 2.01), ("top_p", 0), ("top_k", 2**31), ("top_k", -2), ("seed", 2**63),
                         ("max_tokens", 0), ("max_tokens", 2**31), ("repetition_penalty", 0)):
        with pytest.raises(errors.OpenAIError) as excinfo:
            protocol.parse_request(protocol.ChatCompletionRequest, {**chat, field: value})
        assert excinfo.value.param == field, (field, value)


@pytest.mark.parametrize("field", ["n", "stream", "logprobs", "temperature", "seed", "stop", "max_tokens",
                                   "max_completion_tokens", "top_logprobs", "stream_options", "user"])
def test_null_means_the_default(field):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: None}
    protocol.parse_request(protocol.ChatCompletionRequest, body)


@pytest.mark.parametrize("field, value", [("stream", "yes"), ("stream", 1), ("max_tokens", "16"), ("n", 1.5),
                                          ("temperature", "0.1"), ("ignore_eos", None), ("messages", None)])
def test_types_are_strict(field, value):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(errors.OpenAIError) as excinfo:
        protocol.parse_request(protocol.ChatCompletionRequest, body)
    assert (excinfo.value.status, excinfo.value.param) == (400, field)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}

# The OpenAI API reference's request fields (chat completions and legacy completions) and vLLM's extensions.
OPENAI_CHAT_FIELDS = [
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options"]
OPENAI_COMPLETION_FIELDS = [
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user"]
VLLM_FIELDS = [
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words", "echo", "add_special_tokens",
    "mm_processor_kwargs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
    "prompt_embeds"]
VLLM_CHAT_FIELDS = ["add_generation_prompt", "continue_final_message", "documents", "chat_template",
                    "chat_template_kwargs"]


@pytest.mark.parametrize("model, names", [(protocol.ChatCompletionRequest,
                                           OPENAI_CHAT_FIELDS + VLLM_FIELDS + VLLM_CHAT_FIELDS),
                                          (protocol.CompletionRequest, OPENAI_COMPLETION_FIELDS + VLLM_FIELDS)])
def test_every_known_field_is_served_descriptive_or_refused(model, names):
    """c34's audit: no OpenAI or vLLM field falls through to "unknown"."""
    unclassified = [n for n in names if n not in model.model_fields and n not in protocol.DESCRIPTIVE_FIELDS
                    and n not in model.NOT_SERVED]
    assert not unclassified


@pytest.mark.parametrize("body", [
    {**CHAT, "user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "prompt_cache_key": "x",
     "safety_identifier": "s", "request_id": "r", "parallel_tool_calls": True},
    {**CHAT, "use_beam_search": False, "skip_special_tokens": True, "min_tokens": 0, "stop_token_ids": [],
     "add_special_tokens": False, "echo": False, "priority": 0, "length_penalty": 1.0, "guided_json": None},
    {**COMPLETION, "add_special_tokens": True, "echo": True, "best_of": 1, "include_stop_str_in_output": False},
])
def test_descriptive_fields_and_what_the_server_does_anyway_are_accepted(body):
    model = protocol.ChatCompletionRequest if "messages" in body else protocol.CompletionRequest
    protocol.parse_request(model, body)


@pytest.mark.parametrize("model, body, param, fragment", [
    (protocol.ChatCompletionRequest, {**CHAT, "min_tokens": 5}, "min_tokens", "min_tokens is not supported by "
     "this server (only 0, what it does anyway)"),
    (protocol.ChatCompletionRequest, {**CHAT, "guided_json": {"type": "object"}}, "guided_json", "not supported"),
    (protocol.ChatCompletionRequest, {**CHAT, "reasoning_effort": "low"}, "reasoning_effort", "not supported"),
    (protocol.ChatCompletionRequest, {**CHAT, "add_special_tokens": True}, "add_special_tokens", "only false"),
    (protocol.ChatCompletionRequest, {**CHAT, "use_beam_search": 0}, "use_beam_search", "only false"),
    (protocol.ChatCompletionRequest, {**CHAT, "temprature": 0}, "temprature",
     "Unrecognized request argument supplied: temprature"),
    (protocol.CompletionRequest, {**COMPLETION, "add_special_tokens": False}, "add_special_tokens", "only true"),
    (protocol.CompletionRequest, {**COMPLETION, "prompt_logprobs": 1}, "prompt_logprobs", "not supported"),
])
def test_a_field_that_would_change_the_answer_is_refused_naming_it(model, body, param, fragment):
    with pytest.raises(errors.OpenAIError) as excinfo:
        protocol.parse_request(model, body)
    assert (excinfo.value.status, excinfo.value.param) == (400, param)
    assert fragment in excinfo.value.message


@pytest.mark.parametrize("message, param", [
    ({"role": "user", "content": None}, "messages[0].content"),
    ({"role": "user"}, "messages[0].content"),
    ({"role": "system"}, "messages[0].content"),
    ({"role": "assistant", "content": None}, "messages[0].content"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
     "messages[0].tool_calls[0]"),  # may leave content out, but its calls must be whole
])
def test_c36_a_message_without_content_is_refused_naming_it(message, param):
    with pytest.raises(errors.OpenAIError) as excinfo:
        protocol.parse_request(protocol.ChatCompletionRequest, {"model": "m", "messages": [message]})
    assert (excinfo.value.status, excinfo.value.param) == (400, param)
    assert excinfo.value.message.startswith(param)


def test_chat_template_flags_travel_to_preprocess_when_not_the_default():
    continued = protocol.parse_request(protocol.ChatCompletionRequest, {
        **CHAT, "add_generation_prompt": False, "continue_final_message": True}).generation()
    assert continued.prompts[0].template == {"add_generation_prompt": False, "continue_final_message": True}
    assert protocol.parse_request(protocol.ChatCompletionRequest, {
        **CHAT, "add_generation_prompt": True, "continue_final_message": False}).generation().prompts[0].template == {}


def test_stage_errors_map_by_their_kind_not_their_wording():
    full = errors.from_triton("in ensemble 'omni_chat', " + QueueFull(
        "waiting queue is full: the llm stage holds 4 requests; retry later").wire(), None, "prompt")
    assert (full.status, full.type, full.code, full.headers()) == (
        429, "rate_limit_error", "rate_limit_exceeded", {"Retry-After": "1"})
    assert full.message.startswith("waiting queue is full: the llm stage holds 4 requests")
    hot = errors.from_triton(StageError(ErrorKind.NOT_ADMITTING, "too hot", retry_after_s=30).wire())
    assert hot.status == 503 and hot.headers() == {"Retry-After": "30"}
    # the engine loop's and step's failures are faults whatever their words (an unknown wording was a 400)
    for words in ("engine loop failed (see server log)", "engine step failed (see server log)", "anything"):
        assert errors.from_triton(StageError(ErrorKind.INTERNAL, words).wire()).status == 500
    shutdown = errors.from_triton(StageError(ErrorKind.UNAVAILABLE, "server is shutting down").wire())
    assert shutdown.status == 503
    context = errors.from_triton("in ensemble 'omni_chat', " + StageError(
        ErrorKind.CONTEXT_LENGTH_EXCEEDED, "maximum context length is 8 tokens, you requested 9").wire(),
        None, "messages")
    assert (context.status, context.param, context.code) == (400, "messages", "context_length_exceeded")
    assert context.message.startswith("maximum context length is 8 tokens")
    # a stage's field is named as the client knows it
    seed = errors.from_triton(StageError.of(FieldError("random_seed", "must be an integer"), "x").wire(),
                              "StatusCode.INVALID_ARGUMENT", "prompt")
    assert (seed.param, seed.message) == ("seed", "seed must be an integer")
    part = errors.from_triton(StageError.of(FieldError("text_input[0].content[1]", "(image_url): too big"), "x")
                              .wire(), "StatusCode.INVALID_ARGUMENT", "messages")
    assert (part.param, part.message) == ("messages[0].content[1]", "messages[0].content[1] (image_url): too big")
    # without a header: Triton's own error, by its status (on a stream: a fault)
    assert errors.from_triton("down", "StatusCode.UNAVAILABLE").headers() == {"Retry-After": "1"}
    assert errors.from_triton("unexpected datatype", "StatusCode.INVALID_ARGUMENT").status == 400
    assert errors.from_triton("something new", None).status == 500
    # a call no stage answered: by its gRPC status, naming the stage and address of a tritonserver of its own
    tts = errors.call_failed("UNAVAILABLE", "connection refused", "tts", ("tts", "speech-host:8001"))
    assert (tts.status, tts.headers()) == (503, {"Retry-After": "1"})
    assert tts.message == "the tts stage is unavailable (its tritonserver at speech-host:8001): connection refused"
    assert errors.call_failed("RESOURCE_EXHAUSTED", "busy", "llm").message == "Triton is unavailable: busy"
    assert (errors.call_failed("INTERNAL", "boom", "llm").status,
            errors.call_failed("INTERNAL", "boom", "llm").message) == (500, "the llm call failed: INTERNAL: boom")
    late = errors.call_failed("DEADLINE_EXCEEDED", "Deadline Exceeded", "llm")
    assert (late.status, late.message) == (504, "the llm call timed out: Deadline Exceeded")  # as from_triton's


def test_dead_stub_is_503_for_streams_and_unary_calls():
    """Triton 2.51's "Stub process '<m>_0_0' is not healthy." is a stage that died: 503 + Retry-After, not a
    client error (stream) nor a 500 (unary calls get it as gRPC INTERNAL)."""
    unary = errors.from_triton(
        "Failed to process the request(s) for model instance 'preprocess_0_0', message: "
        "Stub process 'preprocess_0_0' is not healthy.", "StatusCode.INTERNAL", "messages")
    assert (unary.status, unary.code, unary.headers()) == (503, "service_unavailable", {"Retry-After": "1"})
    assert unary.message.startswith("the preprocess stage is down")
    streamed = errors.from_triton("in ensemble 'omni_chat', Stub process 'llm_0_0' is not healthy.")
    assert (streamed.status, streamed.headers()) == (503, {"Retry-After": "1"})
    assert streamed.message.startswith("the llm stage is down")


@pytest.mark.parametrize("upstream_status,message,status,retry_after", [
    (400, QueueFull("waiting queue is full: the llm stage holds 4 requests; retry later").wire(), 429, "1"),
    (200, "in ensemble 'omni_chat', " + QueueFull("waiting queue is full; retry later").wire(), 429, "1"),
    (400, StageError(ErrorKind.NOT_ADMITTING, "too hot; retry after 30 s", retry_after_s=30).wire(), 503, "30"),
    (400, "Stub process 'llm_0_0' is not healthy.", 503, "1"),
    (400, StageError(ErrorKind.UNAVAILABLE, "server is shutting down").wire(), 503, "1"),
    (400, StageError(ErrorKind.INTERNAL, "engine loop failed (see server log)").wire(), 500, None),
    (400, StageError(ErrorKind.CONTEXT_LENGTH_EXCEEDED, "maximum context length is 8 tokens").wire(), 400, None),
    (200, "expected exactly 1 response, got 2", 400, None),
    (404, "Request for unknown model: 'nope' is not found", 404, None),
    (400, "expected number of inputs between 1 and 14 but got 0", 400, None),
])
def test_v2_generate_errors_get_the_status_of_their_kind(upstream_status, message, status, retry_after):
    """/v2/.../generate through the front door: Triton 2.51 answers a decoupled model's every error 400 (or 200);
    the front door answers the kind's status and keeps Triton's body shape {"error": "..."}."""
    from omni_backend.serving.routes.triton_v2 import _generate_error

    response = _generate_error(upstream_status, json.dumps({"error": message}).encode(), "omni_chat")
    assert response.status_code == status
    assert response.headers.get("retry-after") == retry_after
    body = json.loads(response.body)
    assert list(body) == ["error"] and body["error"].startswith(message)


def test_settings_from_environment():
    config = ServingConfig.from_env({"OMNI_GRPC_PORT": "9101", "OMNI_OPENAI_PORT": "9999", "OMNI_API_KEY": "k",
                                     "OMNI_OPENAI_MODELS": "a, b"})
    assert (config.triton_grpc, config.port, config.api_key, config.models) == ("localhost:9101", 9999, "k",
                                                                                 ("a", "b"))
    assert ServingConfig.from_env({}).port == 9000
    with pytest.raises(ValueError):
        ServingConfig.from_env({"OMNI_OPENAI_PORT": "x"})
    assert ServingConfig.from_env({}).graceful_shutdown_s == 30
    assert ServingConfig.from_env({"OMNI_OPENAI_GRACEFUL_SHUTDOWN_S": "7"}).graceful_shutdown_s == 7
    with pytest.raises(ValueError, match="graceful_shutdown_s must be >= 0, got -1"):
        ServingConfig(graceful_shutdown_s=-1)


def test_the_front_door_process_passes_its_shutdown_grace():
    from omni_backend.serving.__main__ import parse_args
    from omni_backend.launch.front_door import FrontDoorProcess

    command = FrontDoorProcess(ServingConfig(graceful_shutdown_s=12, port=9123)).command()
    assert command[command.index("--graceful-shutdown-s") + 1] == "12"
    assert parse_args(command[3:]).graceful_shutdown_s == 12  # after `python -m omni_backend.serving`


def test_preprocess_takes_prompt_token_ids():
    from omni_backend.setup import smollm2
    from omni_backend.stages.preprocess import Preprocessor

    stage = Preprocessor.from_pretrained(str(smollm2.checkpoint_dir()), 2048)
    ids = stage.tokenizer("The capital of France is").input_ids
    out = stage.run({"text_input": np.array([b""], dtype=object), "max_tokens": np.array([4], dtype=np.int32),
                     "prompt_token_ids": np.array(ids, dtype=np.int32)})
    assert out["input_ids"].tolist() == ids
    assert out["prompt_text"][0].decode() == "The capital of France is"
    for bad, field in (([], "prompt_token_ids"), ([1, 10**7], "prompt_token_ids[1]")):
        with pytest.raises(FieldError) as excinfo:
            stage.run({"text_input": np.array([b""], dtype=object), "max_tokens": np.array([4], dtype=np.int32),
                       "prompt_token_ids": np.array(bad, dtype=np.int32)})
        assert excinfo.value.field == field
