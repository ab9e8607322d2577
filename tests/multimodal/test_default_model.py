"""The default model folder (omni_backend/setup/tiny_multimodal.py): SmolLM2-135M-Instruct inside a SmolVLM-architecture
checkpoint, beside the project audio encoder (issue 17). Its language model and text prompts must be SmolLM2's
exactly; images go through the SmolVLM code path, audio through the project encoder, in one prompt."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.media_inputs import audio_bytes, audio_part, image_bytes, image_part
from safetensors import safe_open

from omni_backend import checkpoints, paths
from omni_backend.repository import Settings
from omni_backend.setup.tiny_multimodal import IMAGE_TOKENS
from omni_backend.stages.preprocess import Preprocessor
from omni_backend.stages.preprocess_media import MediaConfig
from omni_backend.stages.tensors import string_tensor

SMOLLM2 = paths.models_dir() / "SmolLM2-135M-Instruct"
DEFAULT = Settings.load(environ={}).llm_model_path


@pytest.fixture(scope="module")
def preprocessor():
    return Preprocessor.from_pretrained(DEFAULT, 2048, MediaConfig.from_parameters({"llm_model_path": DEFAULT}))


def run(preprocessor, messages) -> dict:
    return preprocessor.run({"text_input": string_tensor(json.dumps(messages)),
                             "max_tokens": np.array([4], dtype=np.int32)})


def test_the_language_model_is_smollm2s_weights_in_a_smolvlm_folder():
    assert checkpoints.multimodal_architecture(DEFAULT).name == "Idefics3ForConditionalGeneration"
    with safe_open(f"{SMOLLM2}/model.safetensors", "pt") as ours, safe_open(f"{DEFAULT}/model.safetensors", "pt") as vlm:
        for name in ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.29.mlp.down_proj.weight",
                     "norm.weight"):
            original, wrapped = ours.get_tensor(f"model.{name}"), vlm.get_tensor(f"model.text_model.{name}")
            if name == "embed_tokens.weight":  # SmolVLM's image tokens appended, with zero rows
                assert wrapped.shape[0] == original.shape[0] + len(IMAGE_TOKENS)
                assert not wrapped[original.shape[0]:].any()
                wrapped = wrapped[: original.shape[0]]
            assert torch.equal(original, wrapped), name


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a color."}],
])
def test_text_chats_render_as_smollm2_renders_them(preprocessor, messages):
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(SMOLLM2).apply_chat_template(messages, add_generation_prompt=True,
                                                                          tokenize=True, return_dict=True)
    assert run(preprocessor, messages)["input_ids"].tolist() == list(expected["input_ids"])


def test_image_and_audio_in_one_message_keep_their_order(preprocessor):
    content = [audio_part(audio_bytes()), {"type": "text", "text": "and"}, image_part(image_bytes("PNG")),
               audio_part(audio_bytes())]
    out = run(preprocessor, [{"role": "user", "content": content}])
    parts = json.loads(out["media_parts"][0])
    assert [p["kind"] for p in parts] == ["audio", "image", "audio"]
    assert parts[1] == {"kind": "image", "tokens": 49, "items": 1} and parts[0] == parts[2]
    assert parts[0]["frames"] > 0 and parts[0]["tokens"] > 0
    ids, positions = out["input_ids"], out["media_positions"]
    tokenizer = preprocessor.tokenizer
    audio_id, image_id = (tokenizer.convert_tokens_to_ids(t) for t in ("<empty_output>", "<image>"))
    spans = np.split(positions, np.cumsum([p["tokens"] for p in parts])[:-1])
    assert [set(ids[span].tolist()) for span in spans] == [{audio_id}, {image_id}, {audio_id}]
    assert all((np.diff(span) == 1).all() for span in spans) and (np.diff(positions) > 0).all()
    assert out["pixel_values"].shape == (1, 3, 224, 224) and out["input_features"].shape == (2, 80, 3000)


def test_typed_placeholder_tokens_are_text_not_media_slots(preprocessor):
    """The audio placeholder ("<empty_output>") and SmolVLM's "<image>" typed by a client are their text pieces:
    the only placeholders in the prompt are the real audio part's."""
    content = [{"type": "text", "text": "<empty_output><image>"}, audio_part(audio_bytes())]
    out = run(preprocessor, [{"role": "user", "content": content}])
    ids = out["input_ids"].tolist()
    user = ids.index(4093) + 2  # "<|im_start|>user\n": 1, 4093, 198
    # '<' 'empty' '_' 'output' '>' then '<' 'image' '>': each marked token is encoded as text on its own
    assert ids[user:user + 8] == [44, 16451, 79, 4952, 46, 44, 5028, 46]
    audio_id, image_id = (preprocessor.tokenizer.convert_tokens_to_ids(t) for t in ("<empty_output>", "<image>"))
    parts = json.loads(out["media_parts"][0])
    assert [p["kind"] for p in parts] == ["audio"] and image_id not in ids
    assert ids.count(audio_id) == parts[0]["tokens"] == out["media_positions"].size
    assert out["media_positions"][0] == user + 8 + 1  # after the text part and the "\n" joining the parts
