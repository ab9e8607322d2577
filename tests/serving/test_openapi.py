"""The published API document (serving/openapi.py), built without a server: valid OpenAPI 3.1, every route named,
the limits the routes check (from protocol.py, the vocabulary and the stages' settings), and the `docs` setting.
tests/reliability/test_schema_fuzz.py fuzzes a real front door from it."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from openapi_spec_validator import validate

from omni_backend.serving import ServingConfig, create_app, openapi, protocol
from omni_backend.serving.config import FrontDoorSettings
from omni_backend.serving.routes import speech
from omni_backend.stages.diffusion import ImageLimits
from omni_backend.stages.tts_options import MAX_SPEED, voice_names
from omni_backend.vocabulary import BY_PARAM

GENERATE_INPUTS = ({"name": "text_input", "data_type": "TYPE_STRING"},
                   {"name": "max_tokens", "data_type": "TYPE_INT32"},
                   {"name": "temperature", "data_type": "TYPE_FP32", "optional": True})
LIMITS = ImageLimits(sizes="64x64,96x128", default_size="64x64", max_steps=7, default_steps=3)


@pytest.fixture(scope="module")
def document() -> dict:
    return openapi.document(create_app(ServingConfig()), openapi.Facts(("omni_chat", "other"), LIMITS,
                                                                       GENERATE_INPUTS))


def test_the_document_is_valid_openapi_3_1(document):
    assert document["openapi"].startswith("3.1")
    validate(document)  # raises on an invalid document


def test_every_route_is_a_named_operation(document):
    operations = {(method.upper(), path): operation["operationId"]
                  for path, item in document["paths"].items() for method, operation in item.items()}
    assert operations == {
        ("POST", "/v1/chat/completions"): "createChatCompletion", ("POST", "/v1/completions"): "createCompletion",
        ("POST", "/v1/audio/speech"): "createSpeech", ("POST", "/v1/images/generations"): "createImage",
        ("GET", "/v1/models"): "listModels", ("GET", "/v1/models/{model}"): "retrieveModel",
        ("GET", "/health"): "health", ("GET", "/metrics"): "metrics",
        ("POST", "/reset_prefix_cache"): "resetPrefixCache",
        ("GET", "/v2/health/{kind}"): "tritonHealth", ("GET", "/v2"): "tritonServerMetadata",
        ("GET", "/v2/models/{model}"): "tritonModelMetadata", ("GET", "/v2/models/{model}/config"): "tritonModelConfig",
        ("GET", "/v2/models/{model}/ready"): "tritonModelReady", ("POST", "/v2/models/{model}/infer"): "tritonInfer",
        ("POST", "/v2/models/{model}/generate"): "tritonGenerate",
        ("POST", "/v2/models/{model}/generate_stream"): "tritonGenerateStream",
        ("GET", "/v2/{path}"): "tritonOperatorApi", ("POST", "/v2/{path}"): "tritonOperatorApiPost"}


def _ranges(schema: dict) -> tuple:
    """(minimum or exclusiveMinimum, maximum) of a nullable number property."""
    value = schema["anyOf"][0] if "anyOf" in schema else schema
    return value.get("minimum", value.get("exclusiveMinimum")), value.get("maximum")


def test_limits_are_the_routes_own(document):
    schemas = document["components"]["schemas"]
    chat, completion = schemas["ChatCompletionRequest"], schemas["CompletionRequest"]
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty"):
        allowed = BY_PARAM[name].allowed
        assert _ranges(chat["properties"][name]) == (allowed.low, allowed.high), name
    assert _ranges(chat["properties"]["n"]) == (1, protocol.MAX_N)
    assert _ranges(chat["properties"]["top_logprobs"]) == (0, BY_PARAM["logprobs"].allowed.high)
    assert _ranges(completion["properties"]["logprobs"]) == (0, protocol.MAX_COMPLETION_LOGPROBS)
    assert chat["properties"]["model"]["enum"] == ["omni_chat", "other"]
    assert chat["additionalProperties"] is False and "reasoning_effort" in chat["properties"]

    image = schemas["ImageGenerationRequest"]["properties"]
    assert image["size"]["anyOf"][0]["enum"] == ["auto", "64x64", "96x128"]
    assert image["steps"]["anyOf"][0]["maximum"] == 7
    assert image["prompt"]["maxLength"] == LIMITS.max_prompt_chars
    assert image["model"]["enum"][-2:] == ["omni_chat", "other"]

    voice = schemas["SpeechRequest"]["properties"]
    assert voice["input"]["maxLength"] == speech.MAX_INPUT_CHARS
    assert _ranges(voice["speed"]) == (speech.MIN_SPEED, MAX_SPEED)
    assert set(voice_names()) <= set(schemas["VoiceId"]["properties"]["id"]["enum"])

    generate = schemas["GenerateRequest"]
    assert generate["required"] == ["text_input", "max_tokens"]
    assert generate["properties"]["max_tokens"]["anyOf"][0]["minimum"] == BY_PARAM["max_tokens"].allowed.low


def test_a_number_without_a_fraction_is_an_integer():
    """JSON Schema, which the document is written in, counts 2.0 as an integer: so do the routes."""
    request = protocol.parse_request(protocol.CompletionRequest,
                                     {"model": "m", "prompt": [[5.0, 7]], "n": 2.0, "max_tokens": 3.0})
    assert (request.prompt, request.n, request.max_tokens) == ([[5, 7]], 2, 3)


def test_docs_are_on_by_default_and_a_setting_turns_them_off(monkeypatch):
    assert FrontDoorSettings().docs is True and ServingConfig().docs is True
    assert ServingConfig.from_env({"OMNI_OPENAI_DOCS": "false"}).docs is False
    with pytest.raises(ValueError, match="openai_docs must be true or false"):
        ServingConfig.from_env({"OMNI_OPENAI_DOCS": "maybe"})
    with TestClient(create_app(ServingConfig())) as client:
        for path in ("/docs", "/redoc"):
            answer = client.get(path)
            assert answer.status_code == 200 and "/openapi.json" in answer.text, path
    with TestClient(create_app(ServingConfig(docs=False))) as client:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert client.get(path).status_code == 404, path
