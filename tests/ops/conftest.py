"""Fixtures for ops tests: a tiny random Llama (SmolLM2's tokenizer) for governor tests on a real engine."""

from __future__ import annotations

import pytest
import torch

from omni_backend import paths


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    """A 1-layer random Llama, fast enough that an engine step costs about a millisecond."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    smollm2 = paths.models_dir() / "SmolLM2-135M-Instruct"
    if not (smollm2 / "tokenizer.json").exists():
        pytest.fail(f"{smollm2} missing: run scripts/setup.sh")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)
