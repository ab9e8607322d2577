"""Real test inputs (scikit-image's astronaut photo as PNG/JPEG/WebP data URIs, speech from the Piper voice) and
the chat call and checks the media tests share (tests/multimodal, the c07/c08 cases in tests/reliability)."""

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


def audio_bytes(fmt: str = "WAV", samples: np.ndarray | None = None, rate: int | None = None,
                subtype: str | None = None) -> bytes:
    """`samples` (default: `speech()`) encoded as `fmt`, in libsndfile's default `subtype` for it (WAV: PCM_16)
    unless given (e.g. "FLOAT", which keeps NaN, infinities and values past full scale)."""
    import soundfile

    if samples is None:
        samples, rate = speech()
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def chat(url: str, *parts: dict, text: str = "What is in this picture?", max_tokens: int = 8) -> tuple[int, dict]:
    """A greedy chat request to the front door at `url` with `text` followed by media `parts`; returns
    (HTTP status, parsed JSON body)."""
    import requests

    content = [{"type": "text", "text": text}, *parts]
    body = {"model": "omni_chat", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}
    response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    return response.status_code, response.json()


def chat_answer(body: dict) -> tuple[str, int]:
    """(reply text, prompt tokens) of a chat completion body."""
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]


def assert_ok(status: int, body: dict) -> dict:
    """The request succeeded with a non-empty reply; returns the body."""
    assert status == 200, body
    text, _ = chat_answer(body)
    assert isinstance(text, str) and text, body
    return body


def assert_400(status: int, body: dict, param: str, fragment: str) -> None:
    """A 400 naming `param`, whose message holds `fragment` and no internals (tracebacks, library names)."""
    assert status == 400, body
    assert body["error"]["param"] == param, body
    assert fragment in body["error"]["message"], body
    for internal in ("Traceback", "LibsndfileError", "soundfile", "PIL", "File \""):
        assert internal not in body["error"]["message"], body


def text_only_prompt_tokens(url: str) -> int:
    """Prompt tokens of `chat`'s text alone, plus the newline that joins a part to it."""
    status, body = chat(url, {"type": "text", "text": ""})
    assert_ok(status, body)
    return body["usage"]["prompt_tokens"]


def video_bytes(frames: np.ndarray, fps: int, samples: np.ndarray | None = None, rate: int = 16_000,
                container: str = "matroska", codec: str = "ffv1", audio_codec: str = "pcm_s16le") -> bytes:
    """`frames` uint8 [N, H, W, 3] at `fps` (lossless FFV1 in Matroska by default, so decoding gives them back
    exactly) and, when given, mono float `samples` at `rate` as its audio track (16-bit PCM by default), encoded
    with PyAV."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as out:
        video = out.add_stream(codec, rate=fps)
        video.width, video.height = frames.shape[2], frames.shape[1]
        video.pix_fmt = "bgr0" if codec == "ffv1" else "yuv420p"
        audio = None
        if samples is not None:
            audio = out.add_stream(audio_codec, rate=rate, layout="mono")
        for frame in frames:
            out.mux(video.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        out.mux(video.encode(None))
        if audio is not None:
            pcm = (np.clip(samples, -1, 1) * 32767).astype(np.int16).reshape(1, -1)
            chunk = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
            chunk.sample_rate = rate
            out.mux(audio.encode(chunk))
            out.mux(audio.encode(None))
    return buffer.getvalue()


def video_part(raw: bytes, mime: str = "video/x-matroska", use_audio_in_video: bool | None = None) -> dict:
    body = {"url": data_uri(raw, mime)}
    if use_audio_in_video is not None:
        body["use_audio_in_video"] = use_audio_in_video
    return {"type": "video_url", "video_url": body}
