"""Fixtures for engine tests: the SmolLM2 checkpoint made at setup, a tiny random Qwen2 built here, and a running
LLMService over it."""

from __future__ import annotations

import pytest
import torch

from omni_backend import paths

SMOLLM2 = paths.models_dir() / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    if not (SMOLLM2 / "config.json").exists():
        pytest.fail(f"{SMOLLM2} missing: run scripts/setup.sh")
    return str(SMOLLM2)


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory, smollm2_path) -> str:
    """A random Qwen2 (GQA 4:2, QKV bias, untied head, llama3 RoPE scaling) with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # larger random biases so the bias path matters
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    out = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture()
def service(tiny_qwen2_path):
    """A started LLMService over the tiny Qwen2 (8 sequences, 64 blocks, 512 tokens), shut down after the test."""
    from omni_backend.engine.config import EngineConfig
    from omni_backend.engine.llm_engine import LLMEngine
    from omni_backend.stages.llm.service import LLMService

    svc = LLMService(LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=64,
                                            max_num_seqs=8, max_model_len=512)))
    svc.start()
    yield svc
    svc.shutdown()
