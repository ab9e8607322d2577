"""Typed answers of the front door, for its published OpenAPI document (serving/openapi.py): the OpenAI objects
serving/responses.py, routes/operations.py and routes/images.py build, the error objects of serving/errors.py and
Triton's, and the helpers the routes declare their documentation with (`json_body`, `answers`).

The routes build these answers as dicts (their shapes are tested against the published document by
tests/serving/test_openapi.py and fuzzed by schemathesis); these models only describe them. Field names follow the
OpenAI API reference and Triton's HTTP/REST protocol (KServe v2, kserve/open-inference-protocol).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# ---------------------------------------------------------------------------------------------------------
# Errors


class ErrorDetail(BaseModel):
    message: str = Field(description="What is wrong; names the field at fault where there is one.")
    type: str = Field(description="invalid_request_error, authentication_error, permission_error, "
                                  "rate_limit_error or server_error.")
    param: str | None = Field(description="The request field at fault (`messages[0].content`), or null.")
    code: str | None = Field(description="A machine-readable code (`model_not_found`, `context_length_exceeded`, "
                                         "`unknown_parameter`, ...), or null.")


class ErrorResponse(BaseModel):
    """An OpenAI error object (serving/errors.py)."""

    error: ErrorDetail


class TritonError(BaseModel):
    """Triton's own error shape, kept on `/v2`."""

    error: str


ERROR_MEANINGS = {
    400: "An invalid request; `param` names the field.",
    401: "The API key is missing or wrong (only when the server has one).",
    403: "The operator's key (`omni-admin-key` header) is missing.",
    404: "No such model (`model_not_found`).",
    405: "Triton: a path it does not read as one of its APIs (a model name it cannot parse).",
    413: "The body (decompressed) is over the size limit.",
    415: "The body is not JSON, or its Content-Encoding is not gzip, deflate or identity.",
    429: "Too many requests in flight, or the engine's queue is full (Retry-After says when to retry).",
    500: "A fault in the server.",
    503: "Triton or a stage is unavailable or shutting down (Retry-After says when to retry).",
    504: "A pipeline call ran past its deadline.",
}
GENERATION_ERRORS = (400, 401, 404, 413, 415, 429, 500, 503, 504)
"""The statuses a generation endpoint answers besides 200 (serving/app.py gives the order of the checks)."""


def answers(ok: dict | None = None, errors: tuple[int, ...] = (), error_model: type[BaseModel] = ErrorResponse,
            error_content: dict | None = None, **extra: dict) -> dict:
    """A route's `responses=`: the 200 answer (an OpenAPI response object; its `model` is a pydantic model), then
    `error_model` as JSON for each status of `errors`, plus `error_content` (more media types); `extra` adds more
    responses by status (`r400={...}`)."""
    documented: dict[int | str, dict] = {}
    if ok is not None:
        documented[200] = ok
    for status in errors:
        documented[status] = {"model": error_model, "description": ERROR_MEANINGS[status],
                              **({"content": error_content} if error_content else {})}
    for key, response in extra.items():
        documented[int(key.removeprefix("r"))] = response
    return documented


BODY_MODELS: dict[str, type[BaseModel]] = {}
"""The request body models routes declare with `json_body`, by name (serving/openapi.py puts them in the
document's components)."""


def json_body(model: type[BaseModel] | str, description: str | None = None) -> dict:
    """A route's `openapi_extra` for a JSON request body described by `model` (a name: a schema serving/openapi.py
    builds from the pipeline's facts). The routes read their bodies themselves (serving/request_body.py: the
    checks run in the order serving/app.py gives), so FastAPI never validates the body: this only documents it."""
    name = model if isinstance(model, str) else model.__name__
    if not isinstance(model, str):
        BODY_MODELS[name] = model
    body: dict[str, Any] = {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}
    if description:
        body["description"] = description
    return {"requestBody": body}


# ---------------------------------------------------------------------------------------------------------
# Chat content parts (protocol.ChatCompletionRequest.messages_json; preprocess decodes the media)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class MediaUrl(BaseModel):
    url: str = Field(description="A `data:` URI (base64), or a `file://` path inside the operator's allowed folder.")


class ImageUrlPart(BaseModel):
    type: Literal["image_url"]
    image_url: MediaUrl


class InputAudio(BaseModel):
    data: str = Field(description="The audio file, base64.")
    format: str = Field(description="wav, mp3, flac, ... (what the file is).")


class InputAudioPart(BaseModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class VideoUrlPart(BaseModel):
    type: Literal["video_url"]
    video_url: MediaUrl


CONTENT_PARTS = (TextPart, ImageUrlPart, InputAudioPart, VideoUrlPart)


# ---------------------------------------------------------------------------------------------------------
# Chat and completions (serving/responses.py)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(ge=0, description="Prompt tokens whose KV cache the engine reused.")


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    bytes: list[int]
    logprob: float


class TokenLogprob(TopLogprob):
    logprob: float | None = Field(description="null for a prompt's first token (nothing comes before it).")
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None


FinishReason = Literal["stop", "length", "abort"] | None


class MessageAudio(BaseModel):
    id: str
    data: str = Field(description="The spoken answer, base64, in the requested format.")
    expires_at: int
    transcript: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="The answer's text; null when it is spoken (see `audio`).")
    refusal: None = None
    audio: MessageAudio | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class _Answer(BaseModel):
    """What every chat and completions answer carries, whole or streamed."""

    id: str
    created: int
    model: str
    system_fingerprint: str


class ChatCompletion(_Answer):
    """A whole chat answer. With `"stream": true` the answer is server-sent events instead: one
    `chat.completion.chunk` object per `data:` line (OpenAI's ChatCompletionChunk), then `data: [DONE]`."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(_Answer):
    """A whole completions answer. With `"stream": true`: server-sent events of `text_completion` chunks, then
    `data: [DONE]`."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class DeltaAudio(BaseModel):
    id: str
    data: str | None = Field(None, description="A phrase of the spoken answer: base64 pcm16, 24 kHz.")
    transcript: str | None = None
    expires_at: int | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    audio: DeltaAudio | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionChunk(_Answer):
    """One streamed piece of a chat answer; with `stream_options.include_usage` every chunk has `usage` null and
    a last one with no choices carries it."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(_Answer):
    """One streamed piece of a completions answer (`usage` as in ChatCompletionChunk)."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = None


STREAM_CHUNKS = (ChatCompletionChunk, CompletionChunk)


def event_stream(chunk: type[BaseModel]) -> dict:
    """A response `content` entry for server-sent events of `chunk` objects: each event's `data` is one chunk (or
    an error object once the answer fails mid-stream), the last is `[DONE]` (OpenAPI before 3.2 describes one
    event by `schema`; `contentSchema` is the JSON inside `data`)."""
    data = {"anyOf": [{"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json",
                                            "contentSchema": {"anyOf": [
                                                {"$ref": f"#/components/schemas/{chunk.__name__}"},
                                                {"$ref": "#/components/schemas/ErrorResponse"}]}}]}
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"], "properties": {"data": data},
        "description": f"With `\"stream\": true`: one `data:` event per {chunk.__name__}, then `data: [DONE]`."}}}

# ---------------------------------------------------------------------------------------------------------
# Models, health, operator routes, images


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: None
    # described in the annotation: a class-level value named like the engine's setting would read as a declaration
    max_model_len: Annotated[int | None, Field(description="Longest prompt + completion, tokens (the llm stage's).")]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "degraded"] = Field(description="degraded: a stage on a server of its own cannot serve; "
                                                          "the served models can, the requests needing it get 503.")
    stages_down: dict[str, str] | None = Field(None, description="stage -> why it cannot serve (degraded only).")


class PrefixCacheReset(BaseModel):
    dropped_blocks: int = Field(ge=0, description="Cached KV blocks dropped, over every llm model.")


class GeneratedImage(BaseModel):
    b64_json: str = Field(description="A PNG, base64.")
    revised_prompt: None
    seed: int = Field(description="The seed this image was made with (an extension).")


class ImagesResponse(BaseModel):
    created: int
    data: list[GeneratedImage]


# ---------------------------------------------------------------------------------------------------------
# Triton's HTTP/REST protocol (KServe v2) through /v2


Datatype = Literal["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
                   "FP64", "BYTES", "BF16"]


class InferTensor(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    shape: list[int]
    datatype: Datatype
    data: list[Any] = Field(description="The tensor's elements in row-major order (nested lists allowed).")
    parameters: dict[str, Any] | None = None


class RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    """A KServe v2 inference request (JSON form). Decoupled models (the chat entry points) answer a stream and
    cannot be called here: use `generate_stream`, gRPC streaming or the OpenAI endpoints."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[InferTensor]
    outputs: list[RequestedOutput] | None = None


class TritonAnswer(BaseModel):
    """Triton's answer as it sent it (metadata, config, inference or generate responses)."""

    model_config = ConfigDict(extra="allow")
