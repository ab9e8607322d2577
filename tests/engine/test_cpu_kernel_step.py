"""The CPU engine's float32 step through the C++ kernels (models/llama_cpu.py) and its weight-only int8 mode:
int8 greedy tokens equal transformers' on the same dequantized weights; the fallback where the kernels cannot be
built says why; int8 is refused where it cannot run."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from kernels.cpu_library import CpuKernelUnavailable
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")

def _config(path: str, **overrides) -> EngineConfig:
    settings = dict(model_path=path, dtype="float32", kv_cache_bytes=32 << 20, max_num_batched_tokens=64,
                    max_model_len=256)
    return EngineConfig(**{**settings, **overrides})


def _hf_on_the_engines_int8_weights(model_path: str, engine: LLMEngine):
    """transformers' model with every projection and the output head replaced by what the engine's int8 panels
    multiply by (q * s, dequantized), the input embeddings left in float32 as the engine keeps them."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie from the input table
    missing, unexpected = model.load_state_dict(engine.runner.model.cpu_forward.dequantized_weights(), strict=False)
    assert not unexpected and all("norm" in name or "embed_tokens" in name or "bias" in name for name in missing)
    return model


@pytest.mark.parametrize("model_fixture", ["smollm2_path", "tiny_qwen2_path"])
def test_int8_greedy_equals_transformers_on_the_dequantized_weights(model_fixture, request):
    model_path = request.getfixturevalue(model_fixture)
    engine = LLMEngine(_config(model_path, quantization="int8"))
    assert engine.runner.matmuls == "cpu-kernels-int8" and engine.runner.dtype == torch.float32
    forward = engine.runner.model.cpu_forward
    assert forward.head.format == "int8" and all(layer.qkv.format == "int8" for layer in forward.layers)
    tokenizer = engine.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for q in ("What is the capital of France?", "Name three colors.", "Why is the sky blue?")]
    new_tokens = 10
    ours = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0))
    reference = _hf_on_the_engines_int8_weights(model_path, engine)
    with torch.no_grad():
        for prompt, out in zip(prompts, ours):
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
            if want and want[-1] == reference.generation_config.eos_token_id:
                want = want[:-1]  # the engine reports EOS as finish_reason "stop", not as a token
            assert out.token_ids == want
    if model_fixture == "smollm2_path":  # the real model still answers
        paris = engine.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0.0))[0]
        assert "Paris" in paris.text
    # int8 panels are a quarter of the float32 ones (plus one float32 scale per channel)
    floats = LLMEngine(_config(model_path)).runner.model.cpu_forward
    assert forward.weight_bytes < 0.27 * floats.weight_bytes


def test_without_a_compiler_float32_falls_back_to_onednn_and_int8_is_refused(tiny_qwen2_path, tmp_path,
                                                                             monkeypatch, caplog):
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with caplog.at_level(logging.WARNING, logger="omni_backend.engine.model_runner"):
        engine = LLMEngine(_config(tiny_qwen2_path))
    assert engine.runner.matmuls in ("onednn-packed", "torch")
    assert "CPU matmuls: the C++ kernels cannot be built here, using oneDNN: no C++ compiler" in caplog.text
    assert "cpu matmul kernels: no C++ compiler" in engine.runner.fallback_reason
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0] \
        .completion_tokens == 2
    with pytest.raises(CpuKernelUnavailable, match="no C\\+\\+ compiler"):
        LLMEngine(_config(tiny_qwen2_path, quantization="int8"))


def test_int8_is_refused_where_it_cannot_run(tiny_qwen2_path):
    with pytest.raises(ValueError, match="computes in float32"):
        _config(tiny_qwen2_path, quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="quantization must be one of none, int8"):
        _config(tiny_qwen2_path, quantization="fp8")
    with pytest.raises(ValueError, match="runs on CPU engines only"):
        _config(tiny_qwen2_path, quantization="int8", device="cuda")
