"""`POST /v1/audio/speech`: text to speech with the `tts` stage on Triton (serving/speech_backend.py), one
self-contained request answered with one response per phrase (the first phrase short, so audio starts early).
Chat completions with audio output are serving/spoken.py's.

The route checks that its `input` can be spoken (`stages/tts_input.py`: no control characters, at least one
letter or digit; a 400 on `input` otherwise, never an empty file) and streams the audio as it is made (chunked
transfer): `pcm` (raw 16-bit little-endian mono at 24 kHz, as OpenAI sends it) and `wav` (a header with
open-ended sizes, then the samples at the voice's rate) chunk by chunk; `flac` and `mp3` are encoded once the
last chunk is in (mp3 only where the installed libsndfile can write it; otherwise 400 naming the format).
"""

from __future__ import annotations

import struct
from typing import ClassVar, Literal

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field

from omni_backend.serving import audio_fields, errors, protocol
from omni_backend.serving.errors import invalid
from omni_backend.serving.front_door import door_of, require_api_key
from omni_backend.serving.request_body import read_json
from omni_backend.serving.schemas import GENERATION_ERRORS, answers, json_body
from omni_backend.serving.speech_backend import TTS_MODEL
from omni_backend.stages import tts_audio
from omni_backend.stages.tts_input import unspeakable_reason
from omni_backend.stages.tts_options import MAX_SPEED, MIN_SPEED, SpeechOptions, check_speed, voice_names
from omni_backend.vocabulary import FieldError

# Model names /v1/audio/speech answers to besides the served chat models: the stage's and OpenAI's.
SPEECH_MODEL_NAMES = (TTS_MODEL, "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
MAX_INPUT_CHARS = 4096
SPEECH_FORMATS = {name: name for name in ("mp3", "wav", "flac", "pcm", "opus", "aac")}  # OpenAI's names = ours

SPEAKABLE = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]*[0-9A-Za-z][^\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]*$"
"""What `unspeakable_reason` lets through, as a schema pattern: no control character but tab, newline and carriage
return, and something to speak (the check takes any Unicode letter or digit; the pattern, for tools whose regular
expressions know no Unicode classes, asks for an ASCII one)."""
Voice = Literal[tuple(voice_names())]
SpeechFormat = Literal[tuple(name for name in SPEECH_FORMATS if name in tts_audio.formats())]  # writable here

router = APIRouter(dependencies=[Depends(require_api_key)])


class VoiceId(BaseModel):
    id: Voice


class SpeechRequest(BaseModel):
    """The body of `POST /v1/audio/speech`, as `create_speech` checks it. Other fields are ignored."""

    MODEL_NAMES: ClassVar[tuple[str, ...]] = SPEECH_MODEL_NAMES

    model: str = Field(description="tts-1, tts-1-hd, gpt-4o-mini-tts, tts or a served chat model: all speak with "
                                   "the tts stage.")
    input: str = Field(max_length=MAX_INPUT_CHARS, pattern=SPEAKABLE, description=(
        "The text to speak: no control characters but tab, newline and carriage return, and at least one letter "
        "or digit."))
    voice: Voice | VoiceId = Field(description="An installed voice or an OpenAI voice name (their alias), in any "
                                               "case; or OpenAI's `{\"id\": name}`.")
    response_format: SpeechFormat | None = Field(
        "mp3", description="pcm: raw 16-bit little-endian mono at 24 kHz; wav and pcm stream as they are made.")
    speed: float | None = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED)
    stream_format: Literal["audio"] | None = "audio"


AUDIO_ANSWER = {"description": "The audio (chunked transfer); `X-Sample-Rate` gives the sample rate of pcm and wav.",
                "content": {tts_audio.MEDIA_TYPES[name]: {"schema": {"type": "string", "format": "binary"}}
                            for name in SpeechFormat.__args__}}


@router.post("/v1/audio/speech", operation_id="createSpeech", summary="Text to speech", response_class=Response,
             openapi_extra=json_body(SpeechRequest), responses=answers(AUDIO_ANSWER, GENERATION_ERRORS))
async def create_speech(request: Request):
    """OpenAI's text to speech with the tts stage (Piper), streamed as it is made."""
    door = door_of(request)
    body = await read_json(request, door.config.max_body_bytes)
    door.check_model(body, SPEECH_MODEL_NAMES)
    text = errors.required_text(body, "input")
    if len(text) > MAX_INPUT_CHARS:
        raise invalid(f"input is {len(text)} characters; the limit is {MAX_INPUT_CHARS}", "input")
    reason = unspeakable_reason(text)
    if reason is not None:
        raise invalid(f"input {reason}", "input")
    voice = audio_fields.speech_voice(body.get("voice"), "voice")
    given_format = body.get("response_format")
    audio_format = audio_fields.speech_format("mp3" if given_format is None else given_format, "response_format",
                                          SPEECH_FORMATS)
    try:
        speed = check_speed(errors.number(body, "speed", float, None))
    except FieldError as exc:
        raise invalid(str(exc), "speed") from None
    if body.get("stream_format") not in (None, "audio"):
        raise invalid("stream_format: only 'audio' is supported", "stream_format")
    options = SpeechOptions(voice=voice, audio_format=audio_format, speed=speed)

    admission = door.admitted()
    await admission.__aenter__()
    phrases = door.speech.phrases(text, options, "input", protocol.new_id("speech"))
    try:
        first = await phrases.__anext__()  # errors before any audio keep their own status
        rate = first.rate
        if audio_format in ("flac", "mp3"):  # whole-file formats: encoded once the last phrase is in
            samples = np.concatenate([first.samples] + [piece.samples async for piece in phrases])
            data = tts_audio.encode(samples, rate, audio_format)
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
            yield _raw(first.samples, rate, audio_format)
            async for piece in phrases:
                yield _raw(piece.samples, rate, audio_format)
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
