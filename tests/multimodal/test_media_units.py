"""Media decoding, limits and placeholder insertion without a server; the known-projector embedding test."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from media_inputs import audio_bytes, audio_part, image_bytes, image_part, speech

from omni_backend import paths
from omni_backend.stages import media
from omni_backend.stages.media import MediaLimits
from omni_backend.stages.media_spec import MediaSpec
from omni_backend.stages.preprocess import MediaConfig, Preprocessor

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
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + NOT_AUDIO}}, "not a PNG, JPEG or WebP"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "http(s) image URLs are disabled"),
    (image_part(image_bytes("GIF")), "unsupported image format GIF"),
    ({"type": "input_audio", "input_audio": {"data": NOT_AUDIO, "format": "wav"}}, "unsupported audio format"),
    ({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}, "not valid base64"),
    (audio_part(audio_bytes("WAV", np.zeros(16000 * 31, np.float32), 16000)), "over the limit of 30 s"),
])
def test_bad_media_is_a_value_error_naming_the_part(preprocessor, part, fragment):
    with pytest.raises(ValueError) as excinfo:
        preprocessor.run(chat(part))
    assert excinfo.value.field == "text_input[0].content[1]" and fragment in str(excinfo.value)


def test_limits_on_bytes_pixels_and_parts():
    tight = MediaLimits(max_image_bytes=1000, max_image_pixels=100 * 100, max_media_parts=1)
    with pytest.raises(ValueError, match="larger than the limit of"):
        media.image_bytes_from_url(image_part(image_bytes("PNG"))["image_url"]["url"], "p", tight)
    with pytest.raises(ValueError, match="over the limit of 10000 pixels"):
        media.decode_image(image_bytes("PNG"), "p", tight, 224, [0.5] * 3, [0.5] * 3)
    from transformers import AutoTokenizer

    pre = Preprocessor(AutoTokenizer.from_pretrained(SMOLLM2), 2048, MediaConfig({"image": IMAGE_SPEC}, tight))
    with pytest.raises(ValueError, match=r"content\[2\].*too many image/audio parts.*limit is 1"):
        pre.run(chat(image_part(b"x"), image_part(b"y")))
    with pytest.raises(ValueError, match="no audio encoder"):
        pre.run(chat(audio_part(b"x")))


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
