"""Front door pieces without a server: request validation, error classification, settings, token-id prompts."""

import asyncio
import json

import numpy as np
import pytest

from omni_backend.serving import errors, protocol
from omni_backend.serving.config import ServingConfig
from omni_backend.serving.v2_proxy import V2Proxy


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


def test_dead_stub_is_503_for_streams_and_unary_calls():
    """Triton 2.51's "Stub process '<m>_0_0' is not healthy." is a stage that died: 503 + Retry-After, not a
    client error (stream) nor a 500 (unary calls get it as gRPC INTERNAL)."""
    unary = errors.grpc_status_error(
        "StatusCode.INTERNAL", "Failed to process the request(s) for model instance 'preprocess_0_0', message: "
        "Stub process 'preprocess_0_0' is not healthy.", "messages")
    assert (unary.status, unary.code, unary.headers()) == (503, "service_unavailable", {"Retry-After": "1"})
    assert unary.message.startswith("the preprocess stage is down")
    streamed = errors.stream_error("in ensemble 'omni_chat', Stub process 'llm_0_0' is not healthy.", "prompt")
    assert (streamed.status, streamed.headers()) == (503, {"Retry-After": "1"})
    assert streamed.message.startswith("the llm stage is down")


class _FakeUpstream:
    def __init__(self, status: int, body: dict):
        self.status, self.headers, self._data = status, {"Content-Type": "application/json"}, json.dumps(body).encode()

    async def read(self) -> bytes:
        return self._data

    def release(self) -> None:
        pass


class _FakeDoor:
    def __init__(self, upstream: _FakeUpstream):
        self.upstream = upstream

    def http(self):
        door = self

        class Session:
            async def request(self, *args, **kwargs):
                return door.upstream
        return Session()


class _FakeRequest:
    method, headers, query_params = "POST", {"content-type": "application/json"}, {}

    async def body(self) -> bytes:
        return b'{"text_input": "hi"}'


@pytest.mark.parametrize("upstream_status,message,status,retry_after", [
    (400, "waiting queue is full: the llm stage holds 4 requests (max_num_seqs 2 running + max_queued_requests 2 "
          "waiting); retry later", 429, "1"),
    (200, "in ensemble 'omni_chat', waiting queue is full: the llm stage holds 4 requests; retry later", 429, "1"),
    (400, "not admitting new requests: GPU temperature 95 C is at or above the critical 90 C; retry after 30 s",
     503, "30"),
    (400, "Stub process 'llm_0_0' is not healthy.", 503, "1"),
    (400, "server is shutting down", 503, "1"),
    (400, "engine step failed (see server log)", 500, None),
    (400, "maximum context length is 8 tokens, you requested 9", 400, None),
    (200, "expected exactly 1 response, got 2", 400, None),
    (404, "Request for unknown model: 'nope' is not found", 404, None),
])
def test_v2_generate_errors_get_the_status_their_message_means(upstream_status, message, status, retry_after):
    """/v2/.../generate through the front door: Triton 2.51 answers a decoupled model's every error 400 (or 200);
    the proxy classifies it like the OpenAI endpoints and keeps Triton's body shape {"error": "..."}."""
    proxy = V2Proxy(ServingConfig(), _FakeDoor(_FakeUpstream(upstream_status, {"error": message})))
    response = asyncio.run(proxy.forward("models/llm/generate", _FakeRequest()))
    assert response.status_code == status
    assert response.headers.get("retry-after") == retry_after
    body = json.loads(response.body)
    assert list(body) == ["error"] and isinstance(body["error"], str) and body["error"].startswith(message)


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
