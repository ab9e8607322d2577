"""Front door pieces without a server: request validation, error classification, settings, token-id prompts."""

import numpy as np
import pytest

from omni_backend.serving import errors, protocol
from omni_backend.serving.config import ServingConfig


def test_schema_errors_name_the_field():
    cases = [
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
        ({"model": "m", "messages": [{"role": "user"}, {"role": "bot", "content": "x"}]}, "messages[1].role"),
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
    assert request.prompts() == [[1, 2, 3]] and request.max_tokens == 16
    request = protocol.parse_request(protocol.CompletionRequest, {"model": "m", "prompt": ["a", "b"]})
    assert request.prompts() == ["a", "b"]
    with pytest.raises(errors.OpenAIError) as excinfo:
        protocol.parse_request(protocol.CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 6})
    assert excinfo.value.param == "logprobs"


def test_chat_request_becomes_pipeline_inputs():
    request = protocol.parse_request(protocol.ChatCompletionRequest, {
        "model": "m", "max_completion_tokens": 5, "max_tokens": 9, "seed": 3, "stop": "END", "top_k": 4,
        "messages": [{"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert request.completion_limit == 5
    assert request.messages_json() == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}]
    assert request.sampling_values() == {"random_seed": 3, "top_k": 4, "stop_words": ["END"]}


def test_stream_errors_are_classified_by_the_llm_stage_wording():
    full = errors.stream_error("in ensemble 'omni_chat', waiting queue is full: the llm stage holds 4 requests "
                               "(max_num_seqs 2 running + max_queued_requests 2 waiting); retry later", "prompt")
    assert (full.status, full.type, full.code, full.headers()) == (
        429, "rate_limit_error", "rate_limit_exceeded", {"Retry-After": "1"})
    assert full.message.startswith("waiting queue is full: the llm stage holds 4 requests")
    assert errors.stream_error("server is shutting down", "prompt").status == 503
    hot = errors.stream_error("not admitting new requests: GPU temperature 95 C is at or above the critical 90 C; "
                              "retry after 30 s", "prompt")
    assert hot.status == 503 and hot.headers() == {"Retry-After": "30"}
    assert errors.stream_error("engine step failed (see server log)", "prompt").status == 500
    assert errors.stream_error("llm failed: RuntimeError: boom", "prompt").status == 500
    kv = errors.stream_error("request needs 4000 tokens of KV cache, the whole cache holds 1456", "prompt")
    assert kv.status == 400
    context = errors.stream_error("in ensemble 'omni_chat', maximum context length is 8 tokens, you requested 9",
                                  "messages")
    assert (context.status, context.param, context.code) == (400, "messages", "context_length_exceeded")
    assert not context.message.startswith("in ensemble")


def test_grpc_statuses_map_to_http():
    assert errors.grpc_status_error("StatusCode.INVALID_ARGUMENT", "random_seed must be an integer", "prompt").param == "seed"
    assert errors.grpc_status_error("StatusCode.INVALID_ARGUMENT", "text_input is empty", "messages").message \
        == "messages is empty"
    unavailable = errors.grpc_status_error("StatusCode.UNAVAILABLE", "down", "prompt")
    assert unavailable.status == 503 and unavailable.headers() == {"Retry-After": "1"}
    assert errors.grpc_status_error("StatusCode.INTERNAL", "preprocess failed: x", "prompt").status == 500


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
    from omni_backend.serving.process import FrontDoorProcess

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
    for bad, fragment in (([], "prompt_token_ids is empty"), ([1, 10**7], "prompt_token_ids[1]")):
        with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            stage.run({"text_input": np.array([b""], dtype=object), "max_tokens": np.array([4], dtype=np.int32),
                       "prompt_token_ids": np.array(bad, dtype=np.int32)})
