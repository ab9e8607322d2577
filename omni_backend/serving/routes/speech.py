"""Speech out of the front door: `POST /v1/audio/speech`, and chat completions with `"modalities": ["text",
"audio"]`.

Both use the `tts` stage on Triton (serving/speech_backend.py) with self-contained requests: one gRPC stream
per piece of text, answered with one response per phrase (the first phrase short, so audio starts early).

- `/v1/audio/speech` checks that its `input` can be spoken (`stages/tts_input.py`: no control characters, at
  least one letter or digit; a 400 on `input` otherwise, never an empty file) and streams the audio as it is made
  (chunked transfer): `pcm` (raw 16-bit little-endian mono at 24 kHz, as OpenAI sends it) and `wav` (a header with
  open-ended sizes, then the samples at the voice's rate) chunk by chunk; `flac` and `mp3` are encoded once the
  last chunk is in (mp3 only where the installed libsndfile can write it; otherwise 400 naming the format).
- chat with audio drives the chat pipeline like text chat (serving/generation.py: preprocess, the cancellable
  llm stream, postprocess), cuts the streamed text into phrases with the same `SentenceChunker` the tts stage
  uses for omni_speech, and speaks each phrase that has something to say as soon as it is complete, while the LLM goes
  on. The answer carries OpenAI's `message.audio` (id, base64 data, expires_at, transcript); streamed, each text
  delta is a `delta.audio.transcript` and each phrase's audio a `delta.audio.data` (pcm16 only, as with OpenAI).
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from typing import AsyncIterator

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sse_starlette import ServerSentEvent

from omni_backend.serving import errors, protocol
from omni_backend.serving.admission import run_admitted
from omni_backend.serving.errors import OpenAIError, invalid
from omni_backend.serving.front_door import door_of, require_api_key
from omni_backend.serving.generation import Generation
from omni_backend.serving.request_body import read_json
from omni_backend.serving.responses import SYSTEM_FINGERPRINT
from omni_backend.serving.speech_backend import TTS_MODEL, SpeechBackend
from omni_backend.stages import tts_audio
from omni_backend.stages.tts_input import speech_text, unspeakable_reason
from omni_backend.stages.tts_options import SpeechOptions, check_speed, resolve_voice
from omni_backend.stages.tts_text import SentenceChunker
from omni_backend.vocabulary import FieldError

# Model names /v1/audio/speech answers to besides the served chat models: the stage's and OpenAI's.
SPEECH_MODEL_NAMES = (TTS_MODEL, "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
MAX_INPUT_CHARS = 4096
AUDIO_EXPIRY_S = 3600
CHAT_AUDIO_FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "pcm16": "pcm"}  # OpenAI name -> ours

router = APIRouter(dependencies=[Depends(require_api_key)])


def _voice(value, field: str) -> str:
    if isinstance(value, dict):  # OpenAI also takes {"id": "..."} for a custom voice
        value = value.get("id")
    if not isinstance(value, str):
        raise invalid(f"'{field}' is a required property and must be a string", field)
    try:
        return resolve_voice(value)
    except ValueError as exc:
        raise invalid(str(exc).replace("voice", field, 1), field) from None


def _format(value, field: str, allowed: dict[str, str]) -> str:
    available = set(tts_audio.formats())
    names = [name for name, ours in allowed.items() if ours in available]
    if not isinstance(value, str) or value not in allowed or allowed[value] not in available:
        raise invalid(f"{field} '{value}' is not supported; supported: {', '.join(names)}", field)
    return allowed[value]


def wants_audio(body: dict) -> bool:
    """True for a chat request that asks for audio output (then `chat_with_audio` serves it)."""
    modalities = body.get("modalities")
    return body.get("audio") is not None or (isinstance(modalities, list) and "audio" in modalities)


@router.post("/v1/audio/speech")
async def create_speech(request: Request):
    door = door_of(request)
    body = await read_json(request, door.config.max_body_bytes)
    door.check_model(body, SPEECH_MODEL_NAMES)
    text = errors.required_text(body, "input")
    if len(text) > MAX_INPUT_CHARS:
        raise invalid(f"input is {len(text)} characters; the limit is {MAX_INPUT_CHARS}", "input")
    reason = unspeakable_reason(text)
    if reason is not None:
        raise invalid(f"input {reason}", "input")
    voice = _voice(body.get("voice"), "voice")
    audio_format = _format(body.get("response_format") or "mp3", "response_format",
                           {name: name for name in ("mp3", "wav", "flac", "pcm", "opus", "aac")})
    try:
        speed = check_speed(body.get("speed"))
    except FieldError as exc:
        raise invalid(str(exc), "speed") from None
    if (body.get("stream_format") or "audio") != "audio":
        raise invalid("stream_format: only 'audio' is supported", "stream_format")
    options = SpeechOptions(voice=voice, audio_format=audio_format, speed=speed)

    admission = door.admitted()
    await admission.__aenter__()
    phrases = door.speech.phrases(text, options, "input", protocol.new_id("speech"))
    try:
        _, first, rate = await phrases.__anext__()  # errors before any audio keep their own status
        if audio_format in ("flac", "mp3"):  # whole-file formats: encoded once the last phrase is in
            pieces = [first]
            async for _, samples, _ in phrases:
                pieces.append(samples)
            data = tts_audio.encode(np.concatenate(pieces), rate, audio_format)
            await admission.__aexit__(None, None, None)
            return Response(data, media_type=tts_audio.MEDIA_TYPES[audio_format])
    except BaseException:
        await phrases.aclose()
        await admission.__aexit__(None, None, None)
        raise

    async def chunks():
        try:
            if audio_format == "wav":
                yield _streaming_wav_header(rate)
            yield _raw(first, rate, audio_format)
            async for _, samples, _ in phrases:
                yield _raw(samples, rate, audio_format)
        finally:
            await phrases.aclose()
            await admission.__aexit__(None, None, None)

    return StreamingResponse(chunks(), media_type=tts_audio.MEDIA_TYPES[audio_format],
                             headers={"X-Sample-Rate": str(rate if audio_format == "wav" else tts_audio.PCM_RATE)})


def _raw(samples: np.ndarray, rate: int, audio_format: str) -> bytes:
    return samples.astype("<i2").tobytes() if audio_format == "wav" else tts_audio.pcm_bytes(samples, rate)


def _streaming_wav_header(rate: int) -> bytes:
    """A 16-bit mono WAV header whose sizes say "until the end of the stream" (0xFFFFFFFF), as streamed WAV does."""
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + b"fmt " +
            struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16) + b"data" + struct.pack("<I", 0xFFFFFFFF))


# ---------------------------------------------------------------------------------------------------------
# Chat completions with audio output


async def chat_with_audio(request: Request, door, body: dict, pipeline):
    """Serve a chat completion whose `modalities` include "audio" (see the module docstring).

    Args:
        door: the FrontDoor; pipeline: the served model's TritonPipeline.
    """
    modalities = body.get("modalities") or ["text", "audio"]
    if (not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities)
            or set(modalities) - {"text", "audio"} or "audio" not in modalities):
        raise invalid("modalities must be [\"text\", \"audio\"] for audio output", "modalities")
    audio = body.get("audio")
    if not isinstance(audio, dict):
        raise invalid("'audio' ({\"voice\", \"format\"}) is required when modalities include \"audio\"", "audio")
    voice = _voice(audio.get("voice"), "audio.voice")
    audio_format = _format(audio.get("format"), "audio.format", CHAT_AUDIO_FORMATS)
    plain = {k: v for k, v in body.items() if k not in ("modalities", "audio")}
    req = protocol.parse_request(protocol.ChatCompletionRequest, plain)
    if req.n != 1:
        raise invalid("n must be 1 when audio output is requested", "n")
    if req.stream and audio_format != "pcm":
        raise invalid("streamed audio output needs audio.format 'pcm16'", "audio.format")
    if req.logprobs:
        raise invalid("logprobs are not available with audio output", "logprobs")
    options = SpeechOptions(voice=voice, audio_format=audio_format)
    generation_request = req.generation()
    generation_request.settings["stream"] = True  # phrases are spoken while the LLM goes on
    request_id = protocol.new_id("chatcmpl")
    audio_id = protocol.new_id("audio")
    backend: SpeechBackend = door.speech
    generation = Generation(pipeline, generation_request, request_id)

    def start():
        return generation.start()

    if req.stream:
        events = _stream_events(req, generation, backend, options, request_id, audio_id, SYSTEM_FINGERPRINT)
        return await run_admitted(door, request, generation, start, stream_events=events)
    collected = await run_admitted(door, request, generation, start,
                                   collect=lambda: _collect(generation, backend, options))
    if isinstance(collected, Response):
        return collected
    text, samples, rate, last = collected
    data = tts_audio.encode(samples, rate, audio_format)
    message = {"role": "assistant", "content": None, "refusal": None,
               "audio": {"id": audio_id, "data": base64.b64encode(data).decode("ascii"),
                         "expires_at": protocol.now() + AUDIO_EXPIRY_S, "transcript": text}}
    usage = protocol.usage(last.prompt_tokens or generation.choices[0].prepared.prompt_tokens, last.completion_tokens,
                           last.cached_tokens)
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": protocol.now(), "model": req.model,
                         "system_fingerprint": SYSTEM_FINGERPRINT,
                         "choices": [{"index": 0, "message": message, "logprobs": None,
                                      "finish_reason": last.finish_reason}],
                         "usage": usage})


async def _spoken(generation, backend: SpeechBackend, options: SpeechOptions) -> AsyncIterator[tuple]:
    """Merge the LLM's text deltas with the audio of each completed phrase, spoken while the LLM goes on.

    Yields ("text", step) for every LLM response and ("audio", samples, rate) per phrase in phrase order; the
    last item is ("done", final step). A phrase with nothing to speak (only punctuation or symbols) is part of
    the transcript but gets no audio.
    """
    queue: asyncio.Queue = asyncio.Queue()
    chunker = SentenceChunker()
    tasks: list[asyncio.Task] = []

    def speak(phrase: str) -> None:
        phrase = speech_text(phrase)
        if unspeakable_reason(phrase) is not None:
            return
        task = asyncio.ensure_future(backend.speak(phrase, options, "messages"))
        tasks.append(task)
        task.add_done_callback(lambda _: queue.put_nowait(("spoken", None)))

    async def produce():
        try:
            async for _, step in generation.merged():
                await queue.put(("text", step))
                for phrase in chunker.push(step.text):
                    speak(phrase)
                if step.finish_reason:
                    for phrase in chunker.flush():
                        speak(phrase)
                    await queue.put(("end", step))
                    return
            await queue.put(("error", errors.internal("the chat stream ended before its final response")))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(("error", exc))

    producer = asyncio.ensure_future(produce())
    sent, final = 0, None
    try:
        while True:
            kind, value = await queue.get()
            if kind == "error":
                raise value
            if kind == "text":
                yield ("text", value)
            elif kind == "end":
                final = value
            while sent < len(tasks) and tasks[sent].done():
                samples, rate = tasks[sent].result()
                sent += 1
                yield ("audio", samples, rate)
            if final is not None and sent == len(tasks):
                yield ("done", final)
                return
    finally:
        producer.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(producer, *tasks, return_exceptions=True)
        await generation.close()


async def _collect(generation, backend: SpeechBackend, options: SpeechOptions):
    text, pieces, rate, final = [], [], 0, None
    async for item in _spoken(generation, backend, options):
        if item[0] == "text":
            text.append(item[1].text)
        elif item[0] == "audio":
            pieces.append(item[1])
            rate = item[2] or rate
        else:
            final = item[1]
    samples = np.concatenate(pieces) if pieces else np.zeros(0, np.int16)
    return "".join(text), samples, rate or 22050, final


async def _stream_events(req, generation, backend, options, request_id, audio_id, fingerprint) -> AsyncIterator:
    created = protocol.now()

    def chunk(delta: dict, finish_reason=None) -> ServerSentEvent:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "system_fingerprint": fingerprint,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        if req.include_usage:
            body["usage"] = None
        return ServerSentEvent(json.dumps(body, ensure_ascii=False))

    try:
        yield chunk({"role": "assistant", "content": None})
        final = None
        async for item in _spoken(generation, backend, options):
            if item[0] == "text" and item[1].text:
                yield chunk({"audio": {"id": audio_id, "transcript": item[1].text}})
            elif item[0] == "audio" and item[1].size:
                data = base64.b64encode(tts_audio.pcm_bytes(item[1], item[2])).decode("ascii")
                yield chunk({"audio": {"id": audio_id, "data": data}})
            elif item[0] == "done":
                final = item[1]
        yield chunk({"audio": {"id": audio_id, "expires_at": protocol.now() + AUDIO_EXPIRY_S}},
                    final.finish_reason)
        if req.include_usage:
            body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": req.model,
                    "system_fingerprint": fingerprint, "choices": [],
                    "usage": protocol.usage(final.prompt_tokens or generation.choices[0].prepared.prompt_tokens,
                                            final.completion_tokens, final.cached_tokens)}
            yield ServerSentEvent(json.dumps(body))
        yield ServerSentEvent("[DONE]")
    except OpenAIError as exc:
        yield ServerSentEvent(json.dumps(exc.body()))
        yield ServerSentEvent("[DONE]")


