"""The Qwen2 decoder (Qwen Team, "Qwen2 Technical Report", 2024; the Hugging Face `Qwen2ForCausalLM` config): the
Llama decoder of models/llama.py with a bias on the q/k/v projections, which transformers' Qwen2Attention always
has (its config has no `attention_bias`)."""

from __future__ import annotations

from omni_backend.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Decoder-only LM, `LlamaForCausalLM`'s interface and shapes."""

    @staticmethod
    def qkv_bias(config) -> bool:
        """Always: Qwen2's q/k/v projections carry a bias."""
        return True
