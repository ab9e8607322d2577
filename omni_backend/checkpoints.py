"""Which Hugging Face checkpoint folders the product serves, read from their `config.json` (no torch import).

A text-only folder (`LlamaForCausalLM`, `Qwen2ForCausalLM`) is served by the llm stage alone. A multimodal
folder (`Idefics3ForConditionalGeneration` / `SmolVLMForConditionalGeneration`, `LlavaForConditionalGeneration`,
`Qwen2AudioForConditionalGeneration`) is served whole: its language model by the llm stage, its tower and
connector by the image or audio encoder stage (stages/hf_encoders.py), its processor by preprocess
(stages/hf_prompt.py), every part read from the same folder under the checkpoint's own tensor names.

Raises (everywhere here): ValueError naming an unsupported architecture and the supported list.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TEXT_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class MultimodalArchitecture:
    """One multimodal architecture.

    Attributes:
        name: `architectures[0]` of its config.json.
        kind: the media it reads, "image" or "audio".
        token_key: the config.json key holding the placeholder token id its processor expands.
    """

    name: str
    kind: str
    token_key: str


MULTIMODAL_ARCHITECTURES = {a.name: a for a in (
    MultimodalArchitecture("Idefics3ForConditionalGeneration", "image", "image_token_id"),
    MultimodalArchitecture("SmolVLMForConditionalGeneration", "image", "image_token_id"),
    MultimodalArchitecture("LlavaForConditionalGeneration", "image", "image_token_index"),
    MultimodalArchitecture("Qwen2AudioForConditionalGeneration", "audio", "audio_token_index"),
)}
SUPPORTED = (*TEXT_ARCHITECTURES, *MULTIMODAL_ARCHITECTURES)

# Where a multimodal checkpoint keeps its language model, as the Hugging Face hub checkpoints of these
# architectures name it (transformers' save_pretrained writes the same names): Idefics3/SmolVLM under
# `model.text_model.`, LLaVA and Qwen2-Audio under `language_model.model.` with the head at
# `language_model.lm_head.`; newer LLaVA-family saves use `model.language_model.`. Longest prefixes first.
_TEXT_PREFIXES = ("model.text_model.", "model.language_model.", "language_model.model.", "language_model.", "model.")


def architecture_name(config: dict) -> str:
    """`architectures[0]` of a config.json, checked against `SUPPORTED`.

    Raises:
        ValueError: an architecture the product does not serve (the message names it and the supported list).
    """
    name = (config.get("architectures") or ["(none given)"])[0]
    if name not in SUPPORTED:
        raise ValueError(f"unsupported architecture {name}; supported: {', '.join(SUPPORTED)}")
    return name


def read_config(folder: str | Path) -> dict:
    """The folder's config.json.

    Raises:
        FileNotFoundError: the folder has no config.json.
    """
    return json.loads((Path(folder) / "config.json").read_text())


def multimodal_architecture(folder: str | Path) -> MultimodalArchitecture | None:
    """The folder's multimodal architecture, or None for a text-only checkpoint (or a folder without config.json,
    such as the project's own encoder folders).

    Raises:
        ValueError: an unsupported architecture.
    """
    try:
        config = read_config(folder)
    except FileNotFoundError:
        return None
    return MULTIMODAL_ARCHITECTURES.get(architecture_name(config))


def text_hidden_size(folder: str | Path) -> int:
    """The language model's hidden size (`text_config.hidden_size` of a multimodal checkpoint).

    Raises:
        FileNotFoundError: no config.json; KeyError: no hidden size in it.
    """
    config = read_config(folder)
    return int(config.get("text_config", config)["hidden_size"])


def text_weight_name(stored: str) -> str:
    """A checkpoint tensor name as the language model's own name (`layers.0.self_attn.q_proj.weight`,
    `lm_head.weight`): the first matching prefix of `_TEXT_PREFIXES` removed. Tower and connector names come
    out unchanged apart from a leading `model.`; the language model never asks for them."""
    for prefix in _TEXT_PREFIXES:
        if stored.startswith(prefix):
            return stored[len(prefix):]
    return stored
