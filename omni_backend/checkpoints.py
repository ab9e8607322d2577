"""A Hugging Face checkpoint folder as the product reads it: its `config.json` (no torch import) and its row of the
model registry (`omni_backend.engine.models.registry`).

A text-only folder (`LlamaForCausalLM`, `Qwen2ForCausalLM`) is served by the llm stage alone. A multimodal folder
(Idefics3/SmolVLM, LLaVA, Qwen2-Audio) is served whole: its language model by the llm stage, its tower and
connector by the image or audio encoder stage, its processor by preprocess, every part read from the same folder
under the checkpoint's own tensor names and each named by its registry row.

Raises (everywhere here): ValueError naming an unsupported architecture and the supported list.
"""

from __future__ import annotations

import json
from pathlib import Path

from omni_backend.engine.models import registry
from omni_backend.engine.models.registry import HF_LANGUAGE_MODEL_PREFIXES, Architecture


def read_config(folder: str | Path) -> dict:
    """The folder's config.json.

    Raises:
        FileNotFoundError: the folder has no config.json.
    """
    return json.loads((Path(folder) / "config.json").read_text())


def config_value(folder: str | Path, key: str):
    """A value of the folder's config.json; a dotted key ("thinker_config.image_token_index") names it inside a
    sub-config.

    Raises:
        FileNotFoundError: no config.json; KeyError: no such key.
    """
    value = read_config(folder)
    for name in key.split("."):
        value = value[name]
    return value


def architecture(folder: str | Path) -> Architecture:
    """The registry row of the folder's `architectures[0]`.

    Raises:
        FileNotFoundError: the folder has no config.json.
        ValueError: an architecture the product does not serve.
    """
    return registry.lookup((read_config(folder).get("architectures") or ["(none given)"])[0])


def multimodal_architecture(folder: str | Path) -> Architecture | None:
    """The folder's multimodal architecture, or None for a text-only checkpoint (or a folder without config.json,
    such as the project's own encoder folders).

    Raises:
        ValueError: an unsupported architecture.
    """
    try:
        found = architecture(folder)
    except FileNotFoundError:
        return None
    return found if found.multimodal else None


def text_hidden_size(folder: str | Path) -> int:
    """The language model's hidden size (`text_config.hidden_size` of a multimodal checkpoint).

    Raises:
        FileNotFoundError: no config.json; KeyError: no hidden size in it.
    """
    config = read_config(folder)
    return int(config.get("text_config", config)["hidden_size"])


def head_dim(text_config) -> int:
    """The attention head width of a language model's transformers config: its `head_dim` where it sets one (Qwen3's
    and Gemma's heads do not tile the hidden size), else hidden_size // num_attention_heads (Llama's, Qwen2's rule)."""
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def text_weight_name(stored: str, prefixes: tuple[str, ...] = HF_LANGUAGE_MODEL_PREFIXES) -> str:
    """A checkpoint tensor name as the language model's own name (`layers.0.self_attn.q_proj.weight`,
    `lm_head.weight`): the first of `prefixes` it starts with removed (an architecture's `weight_prefixes`).
    Tower and connector names come out unchanged apart from a matching prefix; the language model never asks for
    them."""
    for prefix in prefixes:
        if stored.startswith(prefix):
            return stored[len(prefix):]
    return stored
