"""Engine greedy decoding equals Hugging Face transformers greedy decoding token for token (fp32)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
    "Explain photosynthesis in one sentence.", "What is 12 times 7?", "Name a famous physicist.",
    "Translate 'good morning' to Spanish.", "What does a CPU do?", "Give me a synonym for happy.",
    "Why is the sky blue?", "Write one line of Python that prints hello.", "Who wrote Hamlet?",
    "What is the boiling point of water in Celsius?", "Describe a cat in five words.",
    "What is the largest planet?", "Suggest a name for a dog.", "How many days are in a leap year?",
    "What is an API?", "Tell me a fun fact about octopuses.", "Summarize the plot of Cinderella.",
]
NEW_TOKENS = 12


def _hf_greedy(model_path: str, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].tolist()
            if ids and ids[-1] == model.generation_config.eos_token_id:
                ids = ids[:-1]  # the engine reports the EOS token as finish_reason "stop", not as output
            outputs.append(ids)
    return outputs


@pytest.mark.parametrize("model_fixture", ["smollm2_path", "tiny_qwen2_path"])
def test_engine_greedy_equals_hf(model_fixture, request):
    model_path = request.getfixturevalue(model_fixture)
    engine = LLMEngine(EngineConfig(model_path=model_path, dtype="float32", kv_cache_bytes=64 << 20,
                                    max_num_batched_tokens=256, max_model_len=512))
    tokenizer = engine.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    if shutil.which(os.environ.get("CXX", "g++")):
        assert engine.runner.matmuls == "cpu-kernels-float32"  # the CPU default: the C++ step, no fallback
    ours = engine.generate(prompts, params)
    expected = _hf_greedy(model_path, prompts)
    for question, out, ref in zip(QUESTIONS, ours, expected):
        assert out.token_ids == ref, f"{model_fixture}: {question!r}"
    # the step budget (256) is below the summed prompt lengths, so prefill was chunked across steps
    assert sum(len(p) for p in prompts) > 256
    assert engine.runner.block_manager.num_free_blocks == engine.runner.num_blocks
