"""The engine on the OpenAI-Triton attention backend (interpreter on CPU, kernels on CUDA) gives the same
greedy tokens as on the torch backend, also for a prompt whose prefix comes from the prefix cache."""

from __future__ import annotations

import os

import torch

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams


def test_triton_backend_tokens_equal_torch_backend(tiny_qwen2_path):
    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"  # set by tests/conftest.py
    prompts = [list(range(200, 219)), list(range(500, 505)), [42]]
    # logprobs: a random tiny model repeats tokens, so compare the distributions' top entries too
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    results = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", attention_backend=backend,
                                        num_kv_blocks=16, block_size=16, max_num_seqs=4,
                                        max_num_batched_tokens=16, max_model_len=64))
        assert engine.runner.attention_backend == backend
        # the second time, the 19-token prompt's first block comes from the prefix cache: its prefill starts at
        # position 16 with 16 tokens of context already in the cache
        outputs = engine.generate(prompts, params) + engine.generate(prompts, params)
        assert [o.cached_tokens for o in outputs] == [0, 0, 0, 16, 0, 0]
        results[backend] = [[(lp.token_id, round(lp.logprob, 4)) for lp in o.logprobs] for o in outputs]
    assert results["triton"] == results["torch"]
    assert results["triton"][3:] == results["triton"][:3]
