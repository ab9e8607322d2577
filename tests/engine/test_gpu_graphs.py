"""On a CUDA device: decode through captured CUDA graphs gives the same tokens as eager decode."""

from __future__ import annotations

import pytest
import torch

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_graph_replay_equals_eager(smollm2_path, dtype):
    prompts = [[1] + list(range(100 + 13 * i, 100 + 13 * i + 5 + 7 * i)) for i in range(11)]  # 11 -> bucket 16
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    results = {}
    for eager in (True, False):
        engine = LLMEngine(EngineConfig(model_path=smollm2_path, device="cuda", dtype=dtype, num_kv_blocks=512,
                                        max_num_seqs=16, max_model_len=512, enforce_eager=eager))
        assert engine.runner.attention_backend == "triton"
        results[eager] = [o.token_ids for o in engine.generate(prompts, params)]
        if not eager:
            assert engine.runner.graph_runner.num_replays > 0
            assert engine.runner.graph_runner.num_padded_rows > 0
    assert results[False] == results[True]
