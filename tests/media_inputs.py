"""Real test inputs: scikit-image's astronaut photo as PNG/JPEG/WebP data URIs, speech from the Piper voice."""

from __future__ import annotations

import base64
import functools
import io

import numpy as np


def image_bytes(fmt: str, array: np.ndarray | None = None, **save) -> bytes:
    from PIL import Image
    from skimage import data

    buffer = io.BytesIO()
    Image.fromarray(data.astronaut() if array is None else array).save(buffer, fmt, **save)
    return buffer.getvalue()


def data_uri(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def image_part(raw: bytes, mime: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": data_uri(raw, mime)}}


def audio_part(raw: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(raw).decode(), "format": fmt}}


@functools.lru_cache(maxsize=1)
def speech() -> tuple[np.ndarray, int]:
    """'Hello, what is the weather like today?' spoken by the Piper joe voice (22.05 kHz float32)."""
    from omni_backend.stages.tts import PiperSynthesizer

    synthesizer = PiperSynthesizer.default(threads=1)
    chunks = list(synthesizer.stream("Hello, what is the weather like today?", synthesizer.voices[0]))
    samples = np.concatenate([np.asarray(c).reshape(-1) for c in chunks]).astype(np.float32) / 32768.0
    return samples, synthesizer.sample_rate


def audio_bytes(fmt: str = "WAV", samples: np.ndarray | None = None, rate: int | None = None) -> bytes:
    import soundfile

    if samples is None:
        samples, rate = speech()
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt)
    return buffer.getvalue()
