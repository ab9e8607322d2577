"""Audio containers for the tts stage's 16-bit PCM: WAV, FLAC and MP3 files, raw PCM, and resampling.

WAV is written with the standard library; FLAC and MP3 with `soundfile` (libsndfile, bundled in its wheel;
MP3 needs libsndfile >= 1.1, so `mp3` is offered only when the installed build can write it: `formats()`).
Raw `pcm` follows OpenAI's convention: mono 16-bit little-endian at 24 kHz, so the voice's samples are
resampled (band-limited, by FFT) to `PCM_RATE`.
"""

from __future__ import annotations

import io
import wave
from functools import lru_cache

import numpy as np

PCM_RATE = 24000
"""Sample rate of raw `pcm` output (OpenAI's speech and chat-audio PCM rate)."""


@lru_cache(maxsize=1)
def formats() -> tuple[str, ...]:
    """Container formats this installation can write, in OpenAI's names (`pcm` is always there)."""
    available = ["wav", "pcm"]
    try:
        import soundfile

        kinds = soundfile.available_formats()
        if "FLAC" in kinds:
            available.append("flac")
        if "MP3" in kinds and "MPEG_LAYER_III" in soundfile.available_subtypes("MP3"):
            available.append("mp3")
    except (ImportError, OSError):
        pass
    return tuple(available)


def resample(samples: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """int16 mono samples from `source_rate` to `target_rate` (band-limited FFT resampling of the whole clip)."""
    samples = np.asarray(samples, dtype=np.int16).reshape(-1)
    if source_rate == target_rate or samples.size == 0:
        return samples
    n = samples.size
    m = max(1, int(round(n * target_rate / source_rate)))
    spectrum = np.fft.rfft(samples.astype(np.float64))
    out = np.zeros(m // 2 + 1, dtype=np.complex128)
    keep = min(spectrum.size, out.size)
    out[:keep] = spectrum[:keep]
    result = np.fft.irfft(out, m) * (m / n)
    return np.clip(np.rint(result), -32768, 32767).astype(np.int16)


def pcm_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    """Raw PCM as OpenAI sends it: int16 little-endian mono at `PCM_RATE`."""
    return resample(samples, sample_rate, PCM_RATE).astype("<i2").tobytes()


def encode(samples: np.ndarray, sample_rate: int, audio_format: str) -> bytes:
    """A whole clip (int16 mono) as a file in `audio_format` ("wav", "flac", "mp3") or raw "pcm". An empty clip
    is a valid file too (flac and mp3 hold one sample of silence: libsndfile writes nothing for zero samples).

    Raises:
        ValueError: a format this installation cannot write (the message lists the ones it can).
    """
    samples = np.asarray(samples, dtype=np.int16).reshape(-1)
    if audio_format not in formats():
        raise ValueError(f"audio format '{audio_format}' is not supported here; supported: {', '.join(formats())}")
    if audio_format == "pcm":
        return pcm_bytes(samples, sample_rate)
    buffer = io.BytesIO()
    if audio_format == "wav":
        with wave.open(buffer, "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(sample_rate)
            out.writeframes(samples.astype("<i2").tobytes())
        return buffer.getvalue()
    import soundfile

    if samples.size == 0:  # nothing to speak (e.g. input of symbols only): libsndfile would write 0 bytes
        samples = np.zeros(1, dtype=np.int16)  # one sample of silence makes a valid, decodable file
    if audio_format == "flac":
        soundfile.write(buffer, samples, sample_rate, format="FLAC", subtype="PCM_16")
    else:
        soundfile.write(buffer, samples, sample_rate, format="MP3", subtype="MPEG_LAYER_III")
    return buffer.getvalue()


def decode_wav(data: bytes) -> tuple[np.ndarray, int]:
    """A 16-bit mono WAV file -> (int16 samples, sample rate)."""
    with wave.open(io.BytesIO(data), "rb") as clip:
        if clip.getsampwidth() != 2 or clip.getnchannels() != 1:
            raise ValueError("only 16-bit mono WAV is read here")
        return np.frombuffer(clip.readframes(clip.getnframes()), dtype="<i2").astype(np.int16), clip.getframerate()


MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg"}
