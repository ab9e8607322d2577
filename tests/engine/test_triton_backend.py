"""The engine on the OpenAI-Triton attention backend (interpreter on CPU, kernels on CUDA) gives the same
greedy tokens as on the torch backend, also for a prompt whose prefix comes from the prefix cache."""

from __future__ import annotations

import os

import pytest
import torch

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams


def test_triton_backend_tokens_equal_torch_backend(tiny_qwen2_path):
    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"  # set by tests/conftest.py
    prompts = [list(range(200, 219)), list(range(500, 505)), [42]]
    # logprobs: a random tiny model repeats tokens, so compare the distributions' top entries too. They are compared
    # within 1e-4 nats, not rounded: the two backends reduce in different orders (float32 differences ~1e-5), and a
    # value next to a rounding boundary split them on an Intel CPU without AMX (-10.0530 against -10.0529)
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
        results[backend] = [[(lp.token_id, lp.logprob) for lp in o.logprobs] for o in outputs]
    for triton_run, torch_run in zip(results["triton"], results["torch"], strict=True):
        assert [t for t, _ in triton_run] == [t for t, _ in torch_run]
        assert [lp for _, lp in triton_run] == pytest.approx([lp for _, lp in torch_run], abs=1e-4)
    for cached, first in zip(results["triton"][3:], results["triton"][:3], strict=True):
        assert [t for t, _ in cached] == [t for t, _ in first]
        assert [lp for _, lp in cached] == pytest.approx([lp for _, lp in first], abs=1e-4)
