"""Media decoding and limits for image, audio and video content parts (used by the preprocess stage).

Images arrive as `data:` URIs (PNG, JPEG, WebP or GIF; http(s) URLs only when `allow_http` is set, off by default)
and pass one decode step (`open_image` -> `to_rgb`) whatever reads them next, so every model sees the picture an
image viewer shows: EXIF orientation applied, transparency composited on white, 16-bit and palette modes
converted to 8-bit RGB, an animation's first frame. The project vision encoder's input is then resized to the
encoder's square size with bicubic filtering and normalized with its mean/std, as SigLIP's image processor does
(`decode_image`); a checkpoint's own processor takes the RGB image (`hf_prompt`). Audio arrives base64-encoded
(WAV, FLAC, OGG and MP3, recognized by content with libsndfile through `soundfile`), must hold only finite
samples, is clipped to full scale, mixed to mono and resampled to 16 kHz. Video arrives as a `data:` URI or, when the
operator allows a folder, a `file://` path inside it; PyAV (FFmpeg's demuxers and decoders) reads the container,
the frames the model's processor samples go through the same `to_rgb` as images, and its first audio track can be
decoded to 16 kHz mono (`decode_video`).

Every bad input raises `ValueError` whose message names the content part (e.g. `messages[0].content[1]`) and,
for oversize media, the limit; nothing else escapes, so the caller answers 400 and stays healthy.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import urllib.request
from dataclasses import dataclass

import numpy as np

from omni_backend.settings import SettingGroup, setting

SAMPLE_RATE = 16_000
IMAGE_FORMATS = {"PNG", "JPEG", "WEBP", "GIF"}
IMAGE_FORMAT_NAMES = "PNG, JPEG, WebP or GIF"
# What Pillow raises for data it cannot decode: truncated or damaged files (OSError, EOFError, SyntaxError and
# struct.error from its plugins) and impossible headers (ValueError).
_UNREADABLE = (OSError, ValueError, SyntaxError, EOFError, struct.error)
# Modes whose samples are wider than 8 bits -> the sample value that is full white. Pillow opens 16-bit greyscale
# as I;16* (PNG) or I (other formats); float images (F) hold intensities in [0, 1], as scikit-image's and
# torchvision's float images do. Pillow's own conversions of these modes clip at 255 instead of scaling.
_WIDE_MODES = {"I;16": 65535, "I;16B": 65535, "I;16L": 65535, "I;16N": 65535, "I": 65535, "F": 1.0}
_ALPHA_MODES = {"RGBA", "RGBa", "LA", "La", "PA"}
# EXIF Orientation (TIFF tag 274) -> the `PIL.Image.Transpose` that shows the stored pixels as meant.
_UPRIGHT = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
            7: "TRANSVERSE", 8: "ROTATE_90"}
# A model's own image processor resizes images to at most a few hundred pixels a side (SmolVLM: 2048 before
# splitting); JPEGs over twice this on both sides are decoded at a reduced scale of at least this size first.
LARGE_IMAGE_DRAFT = 2048


@dataclass
class MediaLimits(SettingGroup):
    """Limits of media parts: preprocess settings (constants of its model config, parsed by `from_strings`;
    an absent key keeps its default here)."""

    max_image_bytes: int = setting(10 * 1024 * 1024, "encoded size of one image, bytes", low=1)
    max_image_pixels: int = setting(8192 * 8192, "width x height of one decoded image (decompression bombs stop "
                                    "here; smaller images of any size are resized to the encoder's input)", low=1)
    max_audio_bytes: int = setting(10 * 1024 * 1024, "encoded size of one audio clip, bytes", low=1)
    max_audio_seconds: float = setting(30.0, "duration of one audio clip, s", low=0.0, low_open=True)
    max_video_bytes: int = setting(64 * 1024 * 1024, "encoded size of one video, bytes", low=1)
    max_video_seconds: float = setting(60.0, "duration of one video, s", low=0.0, low_open=True)
    max_video_frames: int = setting(128, "frames one video gives the model (its processor samples them at its fps)",
                                    low=1)
    max_video_pixels: int = setting(3840 * 2160, "width x height of a video's frames", low=1)
    max_media_parts: int = setting(8, "image + audio + video parts in one request", low=1)
    allow_http: bool = setting(False, "fetch http(s) image URLs (off: the server would fetch arbitrary URLs)")


def _b64decode(data: str, where: str) -> bytes:
    """Standard base64 (RFC 4648 section 4), whitespace ignored, with or without its trailing `=` padding (many
    encoders leave it out, RFC 4648 section 3.2).

    Raises:
        ValueError: characters outside the alphabet, or a length no base64 text can have.
    """
    text = "".join(data.split())
    text += "=" * (-len(text) % 4) if not text.endswith("=") else ""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: data is not valid base64") from None


def _mb(n: int) -> str:
    return f"{n / (1024 * 1024):g} MiB"


def image_bytes_from_url(url: str, where: str, limits: MediaLimits) -> bytes:
    """The encoded image of an `image_url.url`: a `data:image/...;base64,` URI (or http(s) when allowed).

    Raises:
        ValueError: malformed URI, bad base64, a disallowed scheme, or more than `max_image_bytes`.
    """
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise ValueError(f"{where}: image_url must be a base64 data URI (data:image/png;base64,...)")
        if len(payload) * 3 // 4 > limits.max_image_bytes + 3:
            raise ValueError(f"{where}: image is larger than the limit of {_mb(limits.max_image_bytes)}")
        data = _b64decode(payload, where)
    elif url.startswith(("http://", "https://")):
        if not limits.allow_http:
            raise ValueError(f"{where}: http(s) image URLs are disabled on this server; send a data: URI")
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                data = response.read(limits.max_image_bytes + 1)
        except OSError as exc:
            raise ValueError(f"{where}: cannot fetch the image URL: {exc}") from None
    else:
        raise ValueError(f"{where}: image_url must be a data: URI")
    if len(data) > limits.max_image_bytes:
        raise ValueError(f"{where}: image is larger than the limit of {_mb(limits.max_image_bytes)}")
    return data


def open_image(data: bytes, where: str, limits: MediaLimits, draft_size: int | None = None):
    """Encoded PNG/JPEG/WebP/GIF -> the 8-bit RGB `PIL.Image` a viewer shows (`to_rgb`), its pixel count checked
    against `max_image_pixels` before any pixel is decoded.

    A large JPEG is decoded at a reduced scale (`draft`) when `draft_size` is given, which keeps an 8000x8000
    photo cheap for an encoder that resizes it to `draft_size` anyway (the draft keeps both sides at least
    `draft_size`, whatever the EXIF orientation).

    Raises:
        ValueError: not an image, a format other than PNG/JPEG/WebP/GIF (named), more than `max_image_pixels`,
            or data that does not decode (naming the format).
    """
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:  # Pillow's own check of the header's size, stricter than ours or not
        limit = min(limits.max_image_pixels, 2 * Image.MAX_IMAGE_PIXELS)
        raise ValueError(f"{where}: image is over the limit of {limit} pixels") from None
    except _UNREADABLE:
        raise ValueError(f"{where}: the data is not a {IMAGE_FORMAT_NAMES} image") from None
    if image.format not in IMAGE_FORMATS:
        raise ValueError(f"{where}: unsupported image format {image.format}; use {IMAGE_FORMAT_NAMES}")
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise ValueError(f"{where}: image has {width}x{height} pixels, over the limit of "
                         f"{limits.max_image_pixels} pixels")
    if image.format == "JPEG" and draft_size:
        image.draft("RGB", (draft_size, draft_size))
    return to_rgb(image, where)


def to_rgb(image, where: str):
    """The picture an image viewer shows, as an 8-bit RGB `PIL.Image` of the displayed size: the decode step of
    every image source, before any resizing.

    - EXIF orientation applied: a photo tagged Orientation=6 is seen upright (an EXIF block Pillow cannot parse
      is ignored, as viewers ignore it).
    - Transparency composited on white, as transformers' `convert_to_rgb` and vLLM do: an alpha channel (RGBA,
      LA, PA) or a transparent palette index / colour key (P, L, RGB and 16-bit greyscale with `transparency`).
      A fully transparent pixel is white whatever colour it stores; an opaque one keeps its colour.
    - 16-bit greyscale (I;16, I) scaled from 0..65535 to 0..255 (rounded), float greyscale (F) from 0..1;
      palette, bilevel, CMYK and YCbCr through Pillow's conversions to RGB.
    - An animated GIF or WebP: its first frame (the frame `Image.open` is at).

    Args:
        image: a `PIL.Image`, opened lazily or already loaded.
        where: the content part, for error messages.

    Raises:
        ValueError: the pixel data does not decode (truncated or damaged), naming the format.
    """
    from PIL import Image

    kind = image.format or image.mode
    try:
        image.load()
        orientation = _exif_orientation(image)
        if image.mode in _WIDE_MODES:
            image = _to_8_bit(image)
        if image.mode in _ALPHA_MODES or "transparency" in image.info:
            rgba = image.convert("RGBA")
            rgb = Image.new("RGB", rgba.size, (255, 255, 255))
            rgb.paste(rgba, mask=rgba)
        else:
            rgb = image.convert("RGB")
    except _UNREADABLE:
        raise ValueError(f"{where}: the {kind} image cannot be decoded (damaged or truncated data)") from None
    upright = _UPRIGHT.get(orientation)
    return rgb if upright is None else rgb.transpose(getattr(Image.Transpose, upright))


def _exif_orientation(image) -> int:
    """The EXIF Orientation tag of a loaded image (1, as stored, when absent or unreadable).

    Read here rather than through `PIL.ImageOps.exif_transpose`, which also rewrites the EXIF block and fails
    doing so on phone photos with odd tag values (Pillow issues 4238, 8605, 8965): the pixels are all we keep.
    """
    from PIL import ExifTags

    try:
        return int(image.getexif().get(ExifTags.Base.Orientation, 1))
    except Exception:  # any damage in a metadata block we only read one number from
        return 1


def _to_8_bit(image):
    """A greyscale image of a `_WIDE_MODES` mode -> mode L (LA where it has a transparent value)."""
    from PIL import Image

    full = _WIDE_MODES[image.mode]
    values = np.asarray(image)
    if full == 1.0:
        grey = np.rint(np.clip(np.nan_to_num(values), 0.0, 1.0) * 255)
    else:  # round(v * 255 / 65535) = round(v / 257), in integers
        grey = (np.clip(values, 0, 65535).astype(np.uint32) + 128) // 257
    out = Image.fromarray(grey.astype(np.uint8), "L")
    transparent = image.info.get("transparency")
    if isinstance(transparent, int) and full != 1.0:
        out.putalpha(Image.fromarray(np.where(values == transparent, 0, 255).astype(np.uint8), "L"))
    return out


def decode_image(data: bytes, where: str, limits: MediaLimits, size: int, mean, std) -> np.ndarray:
    """Encoded PNG/JPEG/WebP/GIF -> float32 [3, size, size] normalized pixels (SigLIP-style processing) of the
    RGB image `open_image` decodes.

    Raises:
        ValueError: what `open_image` raises.
    """
    from PIL import Image

    image = open_image(data, where, limits, draft_size=size).resize((size, size), Image.Resampling.BICUBIC)
    pixels = np.asarray(image, dtype=np.float32) / 255.0
    pixels = (pixels - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def decode_audio(data: str, where: str, limits: MediaLimits) -> np.ndarray:
    """Base64 audio (WAV/FLAC/OGG/MP3, recognized by content; the declared format is not trusted) -> float32
    mono samples at 16 kHz.

    Samples are read as float64 (integer formats scaled to [-1, 1)), must all be finite, and are clipped to full
    scale [-1, 1] as a sound card plays them: a float WAV may store values past it, and a finite but huge value
    would overflow the mono mix, the resampling or the mel power spectrum into infinities and NaN features.

    Raises:
        ValueError: bad base64, "unsupported audio format" for bytes libsndfile cannot read, over
            `max_audio_bytes` or `max_audio_seconds`, an empty clip, or "non-finite samples" (NaN or infinity).
    """
    import soundfile

    if len(data) * 3 // 4 > limits.max_audio_bytes + 3:
        raise ValueError(f"{where}: audio is larger than the limit of {_mb(limits.max_audio_bytes)}")
    raw = _b64decode(data, where)
    if len(raw) > limits.max_audio_bytes:
        raise ValueError(f"{where}: audio is larger than the limit of {_mb(limits.max_audio_bytes)}")
    try:
        with soundfile.SoundFile(io.BytesIO(raw)) as clip:
            rate, frames = clip.samplerate, clip.frames
            seconds = frames / rate if rate > 0 else 0
            if seconds > limits.max_audio_seconds:
                raise ValueError(f"{where}: audio lasts {seconds:.1f} s, over the limit of "
                                 f"{limits.max_audio_seconds:g} s")
            samples = clip.read(dtype="float64", always_2d=True)
    except ValueError:
        raise
    except Exception:  # soundfile.LibsndfileError (a RuntimeError) and friends: not audio it can read
        raise ValueError(f"{where}: unsupported audio format (send WAV, FLAC, OGG or MP3)") from None
    if samples.size == 0:
        raise ValueError(f"{where}: the audio clip is empty")
    if not np.isfinite(samples).all():
        raise ValueError(f"{where}: the audio has non-finite samples (NaN or infinity)")
    samples = np.clip(samples, -1.0, 1.0).mean(axis=1)
    if samples.size / rate > limits.max_audio_seconds:  # frame counts of some formats are only estimates
        raise ValueError(f"{where}: audio lasts {samples.size / rate:.1f} s, over the limit of "
                         f"{limits.max_audio_seconds:g} s")
    return resample(samples, rate, SAMPLE_RATE)


def resample(samples: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """Band-limited resampling by the FFT (exact for signals below both Nyquist rates)."""
    if rate == target:
        return samples.astype(np.float32)
    n_out = max(1, int(round(samples.size * target / rate)))
    spectrum = np.fft.rfft(samples.astype(np.float64))
    keep = n_out // 2 + 1
    out = np.zeros(keep, dtype=np.complex128)
    out[: min(keep, spectrum.size)] = spectrum[: min(keep, spectrum.size)]
    return (np.fft.irfft(out, n_out) * (n_out / samples.size)).astype(np.float32)


@dataclass
class DecodedVideo:
    """A video as a model's processor takes it.

    Attributes:
        frames: the sampled frames, RGB `PIL.Image`s in order (`to_rgb`).
        total_frames: frames the video holds; fps: its frame rate, frames/s.
        audio: its first audio track as float32 mono samples at 16 kHz, when asked for and present, else None.
    """

    frames: list
    total_frames: int
    fps: float
    audio: np.ndarray | None = None


def video_bytes_from_url(url: str, where: str, limits: MediaLimits, allowed_folder: str = "") -> bytes:
    """The encoded video of a `video_url.url`: a base64 `data:` URI, or a `file://` path inside `allowed_folder`
    (the operator's `allowed_local_media_path`; empty: no local files), symbolic links resolved before the check.

    Raises:
        ValueError: malformed URI, bad base64, a path outside the allowed folder or not a readable file, another
            scheme, or more than `max_video_bytes`.
    """
    import os

    too_large = f"{where}: video is larger than the limit of {_mb(limits.max_video_bytes)}"
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise ValueError(f"{where}: video_url must be a base64 data URI (data:video/mp4;base64,...)")
        if len(payload) * 3 // 4 > limits.max_video_bytes + 3:
            raise ValueError(too_large)
        data = _b64decode(payload, where)
    elif url.startswith("file://"):
        if not allowed_folder:
            raise ValueError(f"{where}: local video files are disabled on this server; send a data: URI")
        root = os.path.realpath(allowed_folder)
        path = os.path.realpath(urllib.request.url2pathname(url.removeprefix("file://")))
        if os.path.commonpath([root, path]) != root:
            raise ValueError(f"{where}: the video path is outside the folder this server allows")
        try:
            if os.path.getsize(path) > limits.max_video_bytes:
                raise ValueError(too_large)
            with open(path, "rb") as handle:
                data = handle.read(limits.max_video_bytes + 1)
        except OSError:
            raise ValueError(f"{where}: the video file cannot be read") from None
    else:
        raise ValueError(f"{where}: video_url must be a data: URI" + (" or a file:// path" if allowed_folder else ""))
    if len(data) > limits.max_video_bytes:
        raise ValueError(too_large)
    return data


def decode_video(data: bytes, where: str, limits: MediaLimits, pick, audio: bool = False) -> DecodedVideo:
    """Encoded video (any container and codec FFmpeg reads: MP4, WebM, Matroska, ...) -> the frames `pick` chooses
    and, with `audio`, its first audio track (`DecodedVideo`).

    Args:
        pick: (total frames, fps) -> the indices of the frames the model's processor samples, in order; it raises
            ValueError for a video it cannot sample (too short).
        audio: decode the first audio track too (a video without one gives `audio` None).

    Raises:
        ValueError: data no FFmpeg demuxer reads, no video track, frames over `max_video_pixels`, a duration over
            `max_video_seconds`, more sampled frames than `max_video_frames`, damaged frames, or non-finite audio;
            every message names the part and none the library's internals.
    """
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ValueError(f"{where}: the file has no video track")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > limits.max_video_pixels:
                raise ValueError(f"{where}: video frames have {width}x{height} pixels, over the limit of "
                                 f"{limits.max_video_pixels} pixels")
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            if fps <= 0:
                raise ValueError(f"{where}: the video has no frame rate")
            total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
            seconds = total / fps
            if seconds > limits.max_video_seconds:
                raise ValueError(f"{where}: video lasts {seconds:.1f} s, over the limit of "
                                 f"{limits.max_video_seconds:g} s")
            try:
                indices = list(pick(total, fps))
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            if len(indices) > limits.max_video_frames:
                raise ValueError(f"{where}: the model samples {len(indices)} frames of this video, over the limit of "
                                 f"{limits.max_video_frames} frames")
            wanted = {}
            for index in indices:
                wanted.setdefault(index, len(wanted))
            container.seek(0)
            found: dict[int, object] = {}
            for number, frame in enumerate(container.decode(stream)):
                if number in wanted:
                    found[number] = to_rgb(frame.to_image(), where)
                if number >= indices[-1]:
                    break
            if len(found) != len(wanted):
                raise ValueError(f"{where}: the video is damaged (fewer frames decode than its header declares)")
            samples = _audio_track(container, where) if audio and container.streams.audio else None
    except av.FFmpegError:  # before ValueError: PyAV's InvalidDataError is one, its message the library's
        raise ValueError(f"{where}: unsupported or damaged video (send MP4, WebM or Matroska)") from None
    except ValueError:
        raise
    except Exception:  # whatever else a demuxer or decoder raises on data it cannot read
        raise ValueError(f"{where}: unsupported or damaged video (send MP4, WebM or Matroska)") from None
    if samples is not None and samples.size / SAMPLE_RATE > limits.max_video_seconds + 1:
        raise ValueError(f"{where}: the video's audio lasts {samples.size / SAMPLE_RATE:.1f} s, over the limit of "
                         f"{limits.max_video_seconds:g} s")
    return DecodedVideo([found[i] for i in indices], total, fps, samples)


def _audio_track(container, where: str) -> np.ndarray | None:
    """The container's first audio track as float32 mono at SAMPLE_RATE (FFmpeg's resampler), clipped to full
    scale; None when it holds no sample.

    Raises:
        ValueError: non-finite samples.
    """
    import av

    container.seek(0)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    chunks = []
    for frame in container.decode(container.streams.audio[0]):
        chunks += [out.to_ndarray().reshape(-1) for out in resampler.resample(frame)]
    chunks += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    if not chunks:
        return None
    samples = np.concatenate(chunks).astype(np.float32)
    if not np.isfinite(samples).all():
        raise ValueError(f"{where}: the video's audio has non-finite samples (NaN or infinity)")
    return np.clip(samples, -1.0, 1.0)
