"""`POST /v1/chat/completions` and `POST /v1/completions` (and a clear 400 for the OpenAI endpoints not served).

Each route reads the body, finds the served model, validates the OpenAI request into a GenerationRequest
(serving/protocol.py), runs it (serving/generation.py) and shapes the answer (serving/responses.py). A chat
request asking for audio output is spoken too: in the served model's own voice when it has a talker
(serving/voiced.py), else by the tts stage (serving/spoken.py).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from omni_backend.serving import protocol
from omni_backend.serving.admission import run_admitted
from omni_backend.serving.errors import invalid
from omni_backend.serving.front_door import door_of, require_api_key
from omni_backend.serving.generation import Generation, collect
from omni_backend.serving.request_body import read_json
from omni_backend.serving.responses import completion_object, stream_events
from omni_backend.serving.schemas import (GENERATION_ERRORS, ChatCompletion, ChatCompletionChunk, Completion,
                                          CompletionChunk, answers, event_stream, json_body)
from omni_backend.serving.spoken import SpokenAnswer
from omni_backend.serving.voiced import VoicedAnswer

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions", operation_id="createChatCompletion", summary="Chat completion",
             openapi_extra=json_body(protocol.ChatCompletionRequest),
             responses=answers({"model": ChatCompletion, "content": event_stream(ChatCompletionChunk)},
                               GENERATION_ERRORS))
async def chat_completions(request: Request):
    """OpenAI's chat completions: text, image, audio and video parts in, text (and speech) out; a JSON answer or,
    with `"stream": true`, server-sent events."""
    return await serve(request, protocol.ChatCompletionRequest, "/v1/chat/completions")


@router.post("/v1/completions", operation_id="createCompletion", summary="Completion",
             openapi_extra=json_body(protocol.CompletionRequest),
             responses=answers({"model": Completion, "content": event_stream(CompletionChunk)}, GENERATION_ERRORS))
async def completions(request: Request):
    """OpenAI's (legacy) completions: text or token-id prompts; a JSON answer or, with `"stream": true`, server-sent
    events."""
    return await serve(request, protocol.CompletionRequest, "/v1/completions")


@router.post("/v1/audio/transcriptions", include_in_schema=False)
@router.post("/v1/embeddings", include_in_schema=False)
async def not_served(request: Request):
    door = door_of(request)
    body = await read_json(request, door.config.max_body_bytes)
    if door.pipeline_for(body) is None:
        raise invalid("'model' is a required property", "model")
    raise invalid(f"The model `{body['model']}` does not support {request.url.path}", "model", "model_not_supported")


async def serve(request: Request, request_model: type[protocol.ChatCompletionRequest | protocol.CompletionRequest],
                endpoint: str) -> Response:
    """Read and validate the request, then run it holding an admission slot: an SSE stream, or one JSON answer
    (spoken too when it asks for speech)."""
    door = door_of(request)
    body = await read_json(request, door.config.max_body_bytes)
    pipeline = door.pipeline_for(body)
    asks_audio = request_model is protocol.ChatCompletionRequest and (
        body.get("audio") is not None or "audio" in (body.get("modalities") if isinstance(body.get("modalities"), list)
                                                     else ()))
    voices = await door.voice.voices() if asks_audio else None
    generation_request = protocol.parse_request(request_model, body, voices).generation()
    started = time.monotonic()
    request_id = protocol.new_id("chatcmpl" if generation_request.kind == "chat" else "cmpl")
    generation = Generation(pipeline, generation_request, request_id)
    speech = generation_request.speech
    spoken = None
    if speech is not None:
        spoken = VoicedAnswer(door.voice, speech, generation_request.settings.get("seed")) \
            if generation_request.own_voice else SpokenAnswer(door.speech, speech)

    async def start() -> None:
        await generation.start()
        door.metrics.ttft.labels(endpoint).observe(time.monotonic() - started)

    if generation_request.stream:
        return await run_admitted(door, request, generation, start,
                                  stream_events=stream_events(generation_request, generation, request_id, spoken))
    results = await run_admitted(door, request, generation, start, collect=lambda: collect(
        generation, None if spoken is None else spoken.merged(generation)))
    if isinstance(results, Response):
        return results
    answer = completion_object(generation_request, generation, results, request_id, spoken)
    door.metrics.prompt_tokens.inc(answer["usage"]["prompt_tokens"])
    door.metrics.completion_tokens.inc(answer["usage"]["completion_tokens"])
    return JSONResponse(answer)
