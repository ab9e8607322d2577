"""The model registry: the architectures the product serves, and what runs each part of one.

One table, `ARCHITECTURES`, from a checkpoint's `config.json` `architectures[0]` to an `Architecture`: the engine's
language model class, where the checkpoint keeps that model's tensors, the C++ CPU step the model may use, and for a
multimodal architecture the encoder (tower + connector) of each media kind it reads and its prompt processor. Every
stage that reads a checkpoint folder asks this table (through `omni_backend.checkpoints`), and no other module
tells architectures apart by name.

Classes are named as lazy "module:Class" strings (as vLLM's `model_executor/models/registry.py` does): reading the
table imports neither torch nor transformers (preprocess reads it), and this engine-level module names the
encoders and processors of the stages layer (`omni_backend/stages/models/`) without importing them; `load` imports
one when a stage needs it.

How to add an architecture: docs/architecture.md, "Model registry".
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Mapping

# Where the Hugging Face hub checkpoints of the architectures below keep their language model (transformers'
# save_pretrained writes the same names), first match stripped: Idefics3/SmolVLM under `model.text_model.`, LLaVA
# and Qwen2-Audio under `language_model.model.` with the head at `language_model.lm_head.` (newer LLaVA-family saves
# use `model.language_model.`), text-only checkpoints under `model.`. Longest prefixes first.
HF_LANGUAGE_MODEL_PREFIXES = ("model.text_model.", "model.language_model.", "language_model.model.",
                              "language_model.", "model.")


@dataclass(frozen=True)
class Architecture:
    """One row of the registry.

    Attributes:
        name: `architectures[0]` of the checkpoint's config.json.
        model: "module:Class" of the engine's language model (`omni_backend.engine.models.llama.LlamaForCausalLM`
            is the interface); None for a multimodal architecture whose language model is the text architecture
            registered for its text config's `model_type`, as transformers' `AutoModel` picks it.
        model_type: a text architecture's config `model_type`, by which a multimodal checkpoint's text config finds
            it ("" for the others).
        cpu_step: "module:Class" of the float32 forward through the C++ kernels that the model may use on a CPU
            (`engine.models.llama_cpu.CpuLlamaForward`, whose decode step is the Llama-family layer of
            kernels/cpu_decode_step.cpp); None: the model runs its own torch modules (oneDNN-packed weights).
        weight_prefixes: where the checkpoint keeps the language model's tensors; a stored name loses the first
            prefix it starts with (`checkpoints.text_weight_name`).
        encoders: media kind ("image", "audio") -> "module:Class" of the encoder (tower + connector) the encoder
            stage of that kind runs; empty for a text-only architecture. A model that reads video runs its frames
            through its image encoder.
        placeholders: media kind -> the config.json key of the token id its processor expands for one item (a
            dotted key names it inside a sub-config). A "video" kind is read by the "image" kind's encoder.
        processor: "module:Class" of the prompt processor preprocess renders its chats with (a
            `stages.hf_prompt.ProcessorPrompt`); None for a text-only architecture (the tokenizer's chat template).
        talker_architecture: the row of the model that speaks the language model's answers (Qwen2.5-Omni's talker: its engine
            model and where the checkpoint keeps it), run by a second engine (`EngineConfig.talker`); None: the
            architecture has none.
    """

    name: str
    model: str | None = None
    model_type: str = ""
    cpu_step: str | None = None
    weight_prefixes: tuple[str, ...] = HF_LANGUAGE_MODEL_PREFIXES
    encoders: Mapping[str, str] = field(default_factory=dict)
    placeholders: Mapping[str, str] = field(default_factory=dict)
    processor: str | None = None
    talker_architecture: Architecture | None = None

    @property
    def multimodal(self) -> bool:
        """Whether the checkpoint brings encoders (its language model then lives under a text config)."""
        return bool(self.encoders)


_ENGINE = "omni_backend.engine.models"
_STAGES = "omni_backend.stages.models"
_LLAMA_CPU_STEP = f"{_ENGINE}.llama_cpu:CpuLlamaForward"

# The order is the one error messages list them in.
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", model=f"{_ENGINE}.llama:LlamaForCausalLM", model_type="llama",
                 cpu_step=_LLAMA_CPU_STEP),
    Architecture("Qwen2ForCausalLM", model=f"{_ENGINE}.qwen2:Qwen2ForCausalLM", model_type="qwen2",
                 cpu_step=_LLAMA_CPU_STEP),
    Architecture("Idefics3ForConditionalGeneration", encoders={"image": f"{_STAGES}.idefics3:Idefics3Encoder"},
                 placeholders={"image": "image_token_id"}, processor=f"{_STAGES}.idefics3:Idefics3Prompt"),
    Architecture("LlavaForConditionalGeneration", encoders={"image": f"{_STAGES}.llava:LlavaEncoder"},
                 placeholders={"image": "image_token_index"}, processor=f"{_STAGES}.llava:LlavaPrompt"),
    Architecture("Qwen2AudioForConditionalGeneration", encoders={"audio": f"{_STAGES}.qwen2_audio:Qwen2AudioEncoder"},
                 placeholders={"audio": "audio_token_index"}, processor=f"{_STAGES}.qwen2_audio:Qwen2AudioPrompt"),
    # Its thinker; its talker, run by a second engine (speech out: stages/talker.py, then stages/code2wav.py).
    Architecture("Qwen2_5OmniForConditionalGeneration",
                 model=f"{_ENGINE}.qwen2_5_omni:Qwen2_5OmniThinkerForCausalLM",
                 weight_prefixes=("thinker.model.language_model.", "thinker.model.", "thinker."),
                 encoders={"image": f"{_STAGES}.qwen2_5_omni:Qwen2_5OmniVisionEncoder",
                           "audio": f"{_STAGES}.qwen2_5_omni:Qwen2_5OmniAudioEncoder"},
                 placeholders={"image": "thinker_config.image_token_index",
                               "audio": "thinker_config.audio_token_index",
                               "video": "thinker_config.video_token_index"},
                 processor=f"{_STAGES}.qwen2_5_omni:Qwen2_5OmniPrompt",
                 talker_architecture=Architecture(
                     "Qwen2_5OmniTalker", model=f"{_ENGINE}.qwen2_5_omni:Qwen2_5OmniTalkerForCausalLM",
                     weight_prefixes=("talker.model.", "talker."))),
)}


def lookup(name: str) -> Architecture:
    """The registered architecture called `name`.

    Raises:
        ValueError: an architecture the product does not serve (the message names it and the supported list).
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name}; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def talker(architecture: Architecture) -> Architecture:
    """The row of `architecture`'s talker.

    Raises:
        ValueError: the architecture has no talker.
    """
    if architecture.talker_architecture is None:
        raise ValueError(f"{architecture.name} has no talker (speech out of the language model's answers); "
                         f"architectures with one: {', '.join(a.name for a in ARCHITECTURES.values() if a.talker_architecture)}")
    return architecture.talker_architecture


def language_model(architecture: Architecture, text_model_type: str) -> Architecture:
    """The row whose `model` and `cpu_step` run `architecture`'s language model: its own when it names a model,
    else the text architecture registered for `text_model_type` (the model_type of the checkpoint's text config).

    Raises:
        ValueError: no text architecture is registered for that model_type.
    """
    if architecture.model is not None:
        return architecture
    found = [a for a in ARCHITECTURES.values() if a.model is not None and a.model_type == text_model_type]
    if not found:
        known = ", ".join(a.model_type for a in ARCHITECTURES.values() if a.model_type)
        raise ValueError(f"the language model of this {architecture.name} checkpoint is a {text_model_type!r} model, "
                         f"which no registered text architecture runs (model types: {known})")
    return found[0]


def load(reference: str):
    """The object a "module:Class" reference of the table names, its module imported now.

    Raises:
        ImportError, AttributeError: a reference to nothing (tests/engine/test_model_registry.py loads them all).
    """
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)
