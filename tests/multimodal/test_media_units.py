"""Media decoding, limits and placeholder insertion without a server; the known-projector embedding test."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import numpy as np
import pytest
import torch
from helpers.media_inputs import audio_bytes, audio_part, image_bytes, image_part, speech

from omni_backend import paths
from omni_backend.stages import media
from omni_backend.stages.media import MediaLimits
from omni_backend.stages.media_spec import MediaSpec
from omni_backend.stages.preprocess import Preprocessor
from omni_backend.stages.preprocess_media import MediaConfig
from omni_backend.vocabulary import FieldError

SMOLLM2 = paths.models_dir() / "SmolLM2-135M-Instruct"
IMAGE_SPEC = MediaSpec("image", "<empty_output>", 576, 2, 49,
                       {"image_size": 224, "mean": [0.5] * 3, "std": [0.5] * 3})
AUDIO_SPEC = MediaSpec("audio", "<empty_output>", 576, 4, 375,
                       {"feature_size": 80, "max_frames": 3000, "hop_length": 160})


@pytest.fixture(scope="module")
def preprocessor():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    return Preprocessor(tokenizer, 2048, MediaConfig({"image": IMAGE_SPEC, "audio": AUDIO_SPEC}, MediaLimits()))


def chat(*parts) -> dict:
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]
    return {"text_input": np.array([json.dumps(messages).encode()], dtype=np.object_),
            "max_tokens": np.array([4], dtype=np.int32)}


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_astronaut_decodes_to_normalized_pixels(fmt):
    pixels = media.decode_image(image_bytes(fmt), "part", MediaLimits(), 224, [0.5] * 3, [0.5] * 3)
    assert pixels.shape == (3, 224, 224) and pixels.dtype == np.float32
    assert -1.0 <= pixels.min() < -0.5 and 0.5 < pixels.max() <= 1.0


def test_c07_huge_jpeg_is_resized_cheaply():
    big = np.zeros((8000, 8000, 3), dtype=np.uint8)
    big[::50] = 255
    pixels = media.decode_image(image_bytes("JPEG", big, quality=30), "p", MediaLimits(), 224, [0.5] * 3, [0.5] * 3)
    assert pixels.shape == (3, 224, 224)


@pytest.mark.parametrize("fmt,rate", [("WAV", 22050), ("FLAC", 44100), ("OGG", 48000), ("MP3", 22050)])
def test_audio_formats_are_resampled_to_16k(fmt, rate):
    t = np.arange(rate) / rate
    tone = (0.4 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    raw = audio_bytes(fmt, tone, rate)
    samples = media.decode_audio(base64.b64encode(raw).decode(), "p", MediaLimits())
    assert abs(samples.size - 16000) < 1200  # MP3 adds codec padding
    spectrum = np.abs(np.fft.rfft(samples))
    assert abs(np.argmax(spectrum) * 16000 / samples.size - 440) < 5  # the tone keeps its pitch


def test_speech_clip_gets_placeholders_after_the_text(preprocessor):
    samples, rate = speech()
    out = preprocessor.run(chat(audio_part(audio_bytes("WAV"))))
    parts = json.loads(out["media_parts"][0])
    seconds = samples.size / rate
    assert parts[0]["kind"] == "audio" and abs(parts[0]["tokens"] - seconds * 12.5) < 2
    assert out["input_features"].shape == (1, 80, 3000)


def test_placeholders_stand_where_the_parts_were(preprocessor):
    out = preprocessor.run(chat(image_part(image_bytes("PNG")), {"type": "text", "text": "and this?"},
                                image_part(image_bytes("JPEG"), "image/jpeg")))
    ids, positions = out["input_ids"], out["media_positions"]
    token = preprocessor.tokenizer.convert_tokens_to_ids("<empty_output>")
    assert positions.size == 98 and out["pixel_values"].shape == (2, 3, 224, 224)
    assert (ids[positions] == token).all() and (np.delete(ids, positions) != token).all()
    text = preprocessor.tokenizer.decode(ids)
    assert text.index("What is this?") < text.index("<empty_output>") < text.index("and this?")
    plain = preprocessor.run(chat())
    assert json.loads(plain["media_parts"][0]) == [] and plain["media_positions"].size == 0  # text only: empty
    assert plain["pixel_values"].shape == (0, 3, 224, 224) and plain["input_features"].shape == (0, 80, 3000)


NOT_AUDIO = base64.b64encode(b"This is a text file, not audio.\n" * 20).decode()


@pytest.mark.parametrize("part,fragment", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not base64@@"}}, "not valid base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + NOT_AUDIO}},
     "not a PNG, JPEG, WebP or GIF image"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "http(s) image URLs are disabled"),
    (image_part(image_bytes("BMP")), "unsupported image format BMP; use PNG, JPEG, WebP or GIF"),
    (image_part(image_bytes("PNG")[:-2000]), "the PNG image cannot be decoded (damaged or truncated data)"),
    (image_part(image_bytes("JPEG")[:-4000]), "the JPEG image cannot be decoded (damaged or truncated data)"),
    ({"type": "input_audio", "input_audio": {"data": NOT_AUDIO, "format": "wav"}}, "unsupported audio format"),
    ({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}, "not valid base64"),
    (audio_part(audio_bytes("WAV", np.array([0.1, np.nan, 0.2, np.inf] * 400, np.float32), 16000, "FLOAT")),
     "the audio has non-finite samples (NaN or infinity)"),
    (audio_part(audio_bytes("WAV", np.zeros(16000 * 31, np.float32), 16000)), "over the limit of 30 s"),
])
def test_bad_media_is_a_value_error_naming_the_part(preprocessor, part, fragment):
    with pytest.raises(FieldError) as excinfo:
        preprocessor.run(chat(part))
    assert excinfo.value.field == "text_input[0].content[1]" and fragment in str(excinfo.value)
    assert "Error" not in str(excinfo.value)  # no exception class names: the message is the client's


def test_limits_on_bytes_pixels_and_parts():
    tight = MediaLimits(max_image_bytes=1000, max_image_pixels=100 * 100, max_media_parts=1)
    with pytest.raises(ValueError, match="larger than the limit of"):
        media.image_bytes_from_url(image_part(image_bytes("PNG"))["image_url"]["url"], "p", tight)
    with pytest.raises(ValueError, match="over the limit of 10000 pixels"):
        media.decode_image(image_bytes("PNG"), "p", tight, 224, [0.5] * 3, [0.5] * 3)
    from transformers import AutoTokenizer

    pre = Preprocessor(AutoTokenizer.from_pretrained(SMOLLM2), 2048, MediaConfig({"image": IMAGE_SPEC}, tight))
    with pytest.raises(ValueError, match=r"content\[2\].*too many media parts.*limit is 1"):
        pre.run(chat(image_part(b"x"), image_part(b"y")))
    with pytest.raises(ValueError, match="no audio encoder"):
        pre.run(chat(audio_part(b"x")))


def decoded(raw: bytes, draft_size: int | None = None) -> np.ndarray:
    """The RGB pixels every image source becomes (media.open_image), uint8 [H, W, 3]."""
    image = media.open_image(raw, "p", MediaLimits(), draft_size=draft_size)
    assert image.mode == "RGB"
    return np.asarray(image)


def encoded(image, fmt: str = "PNG", **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def photo(height: int = 96, width: int = 128) -> np.ndarray:
    """An opaque, non-symmetric photo crop (any flip or rotation changes it), uint8 [height, width, 3]."""
    from skimage import data

    return np.ascontiguousarray(data.chelsea()[:height, :width])


def test_c31_transparent_pixels_are_white_whatever_colour_they_store():
    from PIL import Image

    picture = photo()
    hidden = np.zeros(picture.shape[:2], dtype=bool)
    hidden[20:70, 30:100] = True
    rgba = np.dstack([picture, np.where(hidden, 0, 255).astype(np.uint8)])
    rgba[hidden, :3] = 0  # what the encoder wrote under the transparent pixels: black
    white_twin, black_twin = picture.copy(), picture.copy()
    white_twin[hidden], black_twin[hidden] = 255, 0
    seen = decoded(encoded(Image.fromarray(rgba, "RGBA")))
    np.testing.assert_array_equal(seen, white_twin)
    assert not np.array_equal(seen, black_twin)  # convert("RGB") showed this one
    # the same through the vision encoder's input: equal normalized pixels
    inputs = [media.decode_image(encoded(Image.fromarray(x)), "p", MediaLimits(), 224, [0.5] * 3, [0.5] * 3)
              for x in (rgba, white_twin)]
    np.testing.assert_array_equal(*inputs)
    # grey + alpha, and a half-transparent pixel: alpha * colour + (1 - alpha) * white
    la = np.zeros((2, 3, 2), dtype=np.uint8)
    la[..., 0], la[..., 1] = 100, [[0, 128, 255], [255, 255, 0]]
    alpha = la[..., 1] / 255
    expected = np.rint(100 * alpha + 255 * (1 - alpha))
    assert np.abs(decoded(encoded(Image.fromarray(la, "LA")))[..., 0] - expected).max() <= 1


def test_c32_exif_orientation_6_is_seen_upright():
    from PIL import Image

    stored = photo(96, 128)  # the sensor's pixels: the camera was turned 90 degrees
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    tagged = encoded(Image.fromarray(stored), "JPEG", exif=exif, quality=95)
    sideways = np.asarray(Image.open(io.BytesIO(tagged)).convert("RGB"))  # the JPEG's pixels as stored
    upright = np.ascontiguousarray(np.rot90(sideways, k=-1))  # clockwise: what a viewer shows
    assert upright.shape == (128, 96, 3)
    np.testing.assert_array_equal(decoded(tagged), upright)
    np.testing.assert_array_equal(decoded(tagged, draft_size=224), upright)  # the large-JPEG path keeps the tag
    inputs = [media.decode_image(raw, "p", MediaLimits(), 224, [0.5] * 3, [0.5] * 3)
              for raw in (tagged, encoded(Image.fromarray(upright)))]
    np.testing.assert_array_equal(*inputs)


def test_c32_a_damaged_exif_tag_beside_the_orientation_does_not_lose_the_photo():
    """A phone photo whose EXIF holds a signed rational of denominator 0 (Pillow's exif_transpose raises rewriting
    it, Pillow 13) is still seen upright."""
    from PIL import Image

    def entry(tag: int, kind: int, payload: bytes, offset: int) -> tuple[bytes, bytes]:
        if len(payload) <= 4:
            return struct.pack("<HHI", tag, kind, 1) + payload.ljust(4, b"\0"), b""
        return struct.pack("<HHII", tag, kind, 1, offset), payload

    # a little-endian TIFF header, then IFD0 at offset 8 with Orientation (SHORT 6) and XResolution (SRATIONAL -1/0)
    orientation, _ = entry(0x0112, 3, struct.pack("<H", 6), 0)
    resolution, value = entry(0x011A, 10, struct.pack("<ii", -1, 0), 8 + 2 + 2 * 12 + 4)
    exif = b"Exif\0\0II*\0" + struct.pack("<IH", 8, 2) + orientation + resolution + struct.pack("<I", 0) + value
    stored = photo(32, 48)
    raw = encoded(Image.fromarray(stored), "JPEG", exif=exif, quality=95)
    sideways = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
    np.testing.assert_array_equal(decoded(raw), np.rot90(sideways, k=-1))


def test_16_bit_greyscale_is_scaled_not_clipped():
    from PIL import Image

    values = np.array([[0, 128, 129, 257, 30000, 65278, 65535]], dtype=np.uint16)
    seen = decoded(encoded(Image.fromarray(values)))
    np.testing.assert_array_equal(seen[..., 0], [[0, 0, 1, 1, 117, 254, 255]])  # round(v / 257)
    assert (seen == seen[..., :1]).all()
    # a 16-bit transparent value (PNG tRNS) is white
    np.testing.assert_array_equal(decoded(encoded(Image.fromarray(values), transparency=30000))[0, :, 0],
                                  [0, 0, 1, 1, 255, 254, 255])


@pytest.mark.parametrize("mode,values,expected", [
    ("I;16", np.array([[0, 32896, 65535]], np.uint16), [0, 128, 255]),
    ("I", np.array([[-5, 32896, 70000]], np.int32), [0, 128, 255]),
    ("F", np.array([[-0.5, 0.5, 1.5]], np.float32), [0, 128, 255]),
])
def test_wide_modes_of_any_source_scale_to_8_bits(mode, values, expected):
    from PIL import Image

    image = Image.fromarray(values)
    assert image.mode == mode
    np.testing.assert_array_equal(np.asarray(media.to_rgb(image, "frame"))[0], [[v] * 3 for v in expected])


def test_palette_with_a_transparent_index_and_cmyk():
    from PIL import Image

    indices = np.array([[0, 1, 2, 1]], dtype=np.uint8)
    palette = Image.fromarray(indices, "P")
    palette.putpalette([0, 0, 0, 200, 30, 40, 10, 220, 90])  # index 0 is black, and transparent
    expected = [[255, 255, 255], [200, 30, 40], [10, 220, 90], [200, 30, 40]]
    for fmt in ("PNG", "GIF"):
        np.testing.assert_array_equal(decoded(encoded(palette, fmt, transparency=0))[0], expected, err_msg=fmt)
    np.testing.assert_array_equal(decoded(encoded(palette))[0], [[0, 0, 0]] + expected[1:])  # opaque palette
    cmyk = Image.new("CMYK", (16, 16), (0, 255, 255, 0))  # full magenta and yellow: red
    assert np.abs(decoded(encoded(cmyk, "JPEG", quality=100)).astype(int) - [255, 0, 0]).max() <= 3


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_an_animation_is_seen_as_its_first_frame(fmt):
    from PIL import Image

    frames = [Image.new("RGB", (24, 16), colour) for colour in ((250, 0, 0), (0, 0, 250), (0, 250, 0))]
    raw = encoded(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0,
                  **({"lossless": True} if fmt == "WEBP" else {}))
    assert Image.open(io.BytesIO(raw)).n_frames == 3
    np.testing.assert_array_equal(decoded(raw), np.asarray(frames[0]))


def test_a_header_past_pillows_bomb_check_is_over_the_pixel_limit():
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0))  # 400 megapixels, 60 bytes
    bomb = b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    with pytest.raises(ValueError, match="^p: image is over the limit of 67108864 pixels$"):
        media.open_image(bomb, "p", MediaLimits())


def test_c33_audio_must_be_finite_and_loud_finite_audio_gives_finite_features():
    from omni_backend.stages.audio import log_mel

    def decode(samples, rate=16000, subtype="FLOAT"):
        raw = audio_bytes("WAV", samples, rate, subtype)
        return media.decode_audio(base64.b64encode(raw).decode(), "p", MediaLimits())

    tone = np.sin(np.arange(8000) / 5).astype(np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        samples = tone.copy()
        samples[100] = bad
        with pytest.raises(ValueError, match="^p: the audio has non-finite samples"):
            decode(samples)
    # finite samples far past full scale (a float WAV allows them; 1e300 in a double WAV) are clipped to [-1, 1]
    for samples, rate, subtype in ((tone * 3e38, 22050, "FLOAT"), (np.repeat(tone[:, None], 2, 1) * 1e300, 16000,
                                                                    "DOUBLE")):
        clip = decode(samples, rate, subtype)
        assert np.isfinite(clip).all() and np.abs(clip).max() < 2  # the resampler may ring past the clip level
        assert np.isfinite(log_mel(clip)).all()
    np.testing.assert_allclose(decode(tone * 0.5), tone * 0.5, atol=1e-7)  # within full scale: unchanged


def test_known_projector_embeddings_reach_the_llm_at_placeholder_positions(tmp_path, preprocessor):
    """Vision tower -> a projector with known weights -> preprocess positions -> engine: the decoder's
    input rows at the placeholder positions are exactly the encoder outputs."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, SiglipVisionConfig

    from omni_backend.engine.config import EngineConfig
    from omni_backend.engine.llm_engine import LLMEngine
    from omni_backend.engine.sampling_params import SamplingParams
    from omni_backend.engine.sequence import PromptEmbeds
    from omni_backend.stages.media_encoder import EncoderStage, load_encoder, save_encoder
    from omni_backend.stages.vision import VisionEncoder

    hidden = 64
    torch.manual_seed(0)
    encoder = VisionEncoder(SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                               num_hidden_layers=1, image_size=224, patch_size=32), hidden)
    with torch.no_grad():  # known projector: row i of W picks feature i % 32, scaled by (i + 1) / 64; bias 0.5
        weight = torch.zeros(hidden, 32)
        weight[torch.arange(hidden), torch.arange(hidden) % 32] = (torch.arange(hidden) + 1) / 64
        encoder.projector.weight.copy_(weight)
        encoder.projector.bias.fill_(0.5)
    save_encoder(encoder, tmp_path / "vision", "<empty_output>")
    stage = EncoderStage(load_encoder(tmp_path / "vision"))

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    pre = Preprocessor(tokenizer, 256, MediaConfig({"image": MediaSpec.load(tmp_path / "vision")}, MediaLimits()))
    out = pre.run(chat(image_part(image_bytes("PNG"))))
    (embeds,) = stage.run([out["pixel_values"]])
    embeds = embeds[0]
    with torch.no_grad():  # the same numbers by hand: pooled tower features through W and b
        pixels = torch.from_numpy(out["pixel_values"])
        features = encoder.tower(pixel_values=pixels).last_hidden_state  # [1, 49, 32]: grid 7, pool 2 -> 16
        grid = features.transpose(1, 2).reshape(1, 32, 7, 7)
        pooled = torch.nn.functional.avg_pool2d(grid, 2, ceil_mode=True).flatten(2).transpose(1, 2)[0]
        by_hand = pooled[:, torch.arange(hidden) % 32] * (torch.arange(hidden) + 1) / 64 + 0.5
    assert embeds.shape == (16, hidden)
    np.testing.assert_allclose(embeds, by_hand.numpy(), rtol=1e-5, atol=1e-5)

    llm_dir = tmp_path / "llm"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=128,
                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=256)).save_pretrained(llm_dir)
    tokenizer.save_pretrained(llm_dir)
    engine = LLMEngine(EngineConfig(model_path=str(llm_dir), dtype="float32", num_kv_blocks=32, max_num_seqs=2,
                                    max_num_batched_tokens=256, max_model_len=256))
    seen = []  # the decoder's input rows: the first layer's input on either path (torch modules or C++ step)
    engine.runner.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(None if kwargs.get("input_embeds") is None
                                                 else kwargs["input_embeds"].clone()), with_kwargs=True)
    positions = out["media_positions"]
    ids = out["input_ids"].tolist()
    engine.add_request("mm", ids, SamplingParams(max_tokens=1, temperature=0.0),
                       prompt_embeds=PromptEmbeds(torch.from_numpy(positions.astype(np.int64)),
                                                  torch.from_numpy(embeds)))
    while engine.has_unfinished():
        engine.step()
    prefill = next(x for x in seen if x is not None).reshape(-1, hidden)[: len(ids)]  # the prefill step's rows
    np.testing.assert_array_equal(prefill[positions].numpy(), embeds)
    others = np.delete(np.arange(len(ids)), positions)
    table = engine.runner.model.embed_tokens.weight.detach()
    torch.testing.assert_close(prefill[others], table[torch.tensor(ids)[others]])
