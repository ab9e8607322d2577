"""Transformers' own answers for the tiny Hugging Face multimodal checkpoints (omni_backend/setup/
tiny_hf_multimodal.py): the prompt embeddings after the connector and greedy `generate`, for the same chat the
tests send through the product."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
from helpers.media_inputs import audio_bytes, audio_part, image_bytes, image_part

KIND = {"idefics3": "image", "llava": "image", "qwen2_audio": "audio"}  # one media kind each (Qwen2.5-Omni: its file)
QUESTION = "What is this?"


def media_parts(architecture: str, count: int = 1) -> list[dict]:
    """OpenAI content parts: the astronaut photo (PNG, then a 300x200 crop as JPEG) or Piper's spoken question."""
    if KIND[architecture] == "audio":
        return [audio_part(audio_bytes())] * count
    crop = image_bytes("JPEG", _astronaut()[:200, 100:400])
    return [image_part(image_bytes("PNG")), image_part(crop, "image/jpeg")][:count]


def messages(architecture: str, count: int = 1) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}, *media_parts(architecture, count)]}]


def _astronaut() -> np.ndarray:
    from skimage import data

    return data.astronaut()


def transformers_inputs(architecture: str, folder, count: int = 1):
    """The processor's tensors for `messages(architecture, count)`, as a transformers user makes them."""
    from PIL import Image
    from transformers import AutoProcessor

    from omni_backend.stages.media import MediaLimits, decode_audio

    processor = AutoProcessor.from_pretrained(folder)
    kind = KIND[architecture]
    chat = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, *[{"type": kind}] * count]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True)
    if kind == "audio":
        data = base64.b64encode(audio_bytes()).decode()
        clips = [decode_audio(data, "clip", MediaLimits())] * count
        return processor(text=text, audio=clips, sampling_rate=16_000, return_tensors="pt")
    images = []
    for part in media_parts(architecture, count):
        raw = base64.b64decode(part["image_url"]["url"].partition(",")[2])
        images.append(Image.open(io.BytesIO(raw)).convert("RGB"))
    return processor(text=text, images=images if architecture == "llava" else [images], return_tensors="pt")


def transformers_sanitized_ids(architecture: str, folder, text: str) -> list[int]:
    """The prompt ids of transformers' `apply_chat_template(..., sanitize_control_tokens=True)` (control-token
    strings in the client's text encoded as text) for one user message: `text`, then one media part. transformers
    5.24's Idefics3 processor cannot do this with images (it counts a typed "<image>" as a slot)."""
    from PIL import Image
    from transformers import AutoProcessor

    from omni_backend.stages.media import MediaLimits, decode_audio

    if KIND[architecture] == "audio":
        part = {"type": "audio", "audio": decode_audio(base64.b64encode(audio_bytes()).decode(), "clip", MediaLimits())}
    else:
        raw = base64.b64decode(media_parts(architecture)[0]["image_url"]["url"].partition(",")[2])
        part = {"type": "image", "image": Image.open(io.BytesIO(raw)).convert("RGB")}
    chat = [{"role": "user", "content": [{"type": "text", "text": text}, part]}]
    encoded = AutoProcessor.from_pretrained(folder).apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True, sanitize_control_tokens=True)
    return [int(i) for i in encoded["input_ids"][0]]


def transformers_model(architecture: str, folder):
    from transformers import AutoModelForImageTextToText, Qwen2AudioForConditionalGeneration

    cls = Qwen2AudioForConditionalGeneration if KIND[architecture] == "audio" else AutoModelForImageTextToText
    model = cls.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the tests' requests set ignore_eos
    return model


def transformers_prompt_embeds(model, inputs) -> np.ndarray:
    """The embeddings the language model receives, [prompt tokens, hidden] (captured at its input)."""
    captured = {}

    def grab(module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"]

    handle = model.get_decoder().register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    return captured["embeds"][0].numpy()


def transformers_greedy(model, inputs, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
