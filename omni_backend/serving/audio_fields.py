"""The audio fields of speech and spoken-chat requests (`voice`, the audio format), checked as 400s naming the
field: the speech route (`voice`, `response_format`) and chat's `audio` object (`audio.voice`, `audio.format`)."""

from __future__ import annotations

from typing import Any

from omni_backend.serving.errors import invalid
from omni_backend.stages import tts_audio
from omni_backend.stages.tts_options import resolve_voice
from omni_backend.vocabulary import FieldError


def speech_voice(value: Any, field: str, voices: tuple[str, ...] | None = None) -> str:
    """The voice that speaks for `value` (a voice name, or OpenAI's `{"id": name}` for a custom voice): one of the
    served model's own `voices` (any case), or without those an installed tts voice. Raises OpenAIError 400 naming
    `field` when it is no string or no voice this server has."""
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str):
        raise invalid(f"'{field}' is a required property and must be a string", field)
    if voices is not None:
        found = {voice.lower(): voice for voice in voices}.get(value.strip().lower())
        if found is None:
            raise invalid(f"{field} '{value}' is not a voice of this model; its voices: {', '.join(voices)}", field)
        return found
    try:
        return resolve_voice(value)
    except FieldError as exc:
        raise invalid(f"{field} {exc.problem}", field) from None


def speech_format(value: Any, field: str, allowed: dict[str, str]) -> str:
    """tts_audio's name for the audio format `value` (a key of `allowed`, which maps the client's names to ours).
    Raises OpenAIError 400 naming `field`, listing the formats there are, when it is not in `allowed` or cannot be
    written here (mp3 needs a libsndfile that writes it)."""
    available = set(tts_audio.formats())
    names = [name for name, ours in allowed.items() if ours in available]
    if not isinstance(value, str) or value not in allowed or allowed[value] not in available:
        raise invalid(f"{field} '{value}' is not supported; supported: {', '.join(names)}", field)
    return allowed[value]
