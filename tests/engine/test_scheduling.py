"""Continuous batching, preemption by recompute, admission limits, cancellation and the block-table pool, through
the engine (the policy itself, without a model: test_scheduler_policy.py)."""

from __future__ import annotations

import pytest
import torch

from omni_backend.engine.block_manager import BlockManager, BlockTablePool
from omni_backend.engine.device import Device
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.memory import kv_block_bytes
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import Sequence


@pytest.fixture(scope="module")
def qwen_engine_factory(tiny_qwen2_path):
    def make(**overrides) -> LLMEngine:
        values = dict(model_path=tiny_qwen2_path, dtype="float32", block_size=16, num_kv_blocks=64,
                      max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512)
        values.update(overrides)
        return LLMEngine(EngineConfig(**values))
    return make


def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(100, 40000, (length,), generator=g).tolist() for _ in range(n)]


def test_preemption_with_8_blocks_gives_the_same_tokens(qwen_engine_factory):
    """6 concurrent requests needing 3 blocks each at the end share a cache of 8 blocks."""
    prompts = _prompts(6, 20)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = qwen_engine_factory(num_kv_blocks=64)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]

    tight = qwen_engine_factory(num_kv_blocks=8)
    outputs = tight.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" and o.completion_tokens == 24 for o in outputs)
    assert tight.scheduler.num_preemptions > 0
    assert tight.runner.block_manager.num_free_blocks == 8
    assert tight.runner.block_table_pool.num_free_rows == 8


def test_request_that_can_never_fit_is_rejected(qwen_engine_factory):
    engine = qwen_engine_factory(num_kv_blocks=4)  # 64 tokens of cache
    with pytest.raises(ValueError, match="maximum context length is 512 tokens, you requested 530"):
        engine.add_request("a", [5] * 30, SamplingParams(max_tokens=500))
    with pytest.raises(ValueError, match="whole cache holds 64"):
        engine.add_request("b", [5] * 30, SamplingParams(max_tokens=40))
    assert not engine.has_unfinished()


def test_abort_frees_blocks_at_once(qwen_engine_factory):
    engine = qwen_engine_factory()
    engine.add_request("x", _prompts(1, 40)[0], SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.runner.block_manager.num_free_blocks < 64
    final = engine.abort("x")
    assert final.finish_reason == "abort"
    assert engine.runner.block_manager.num_free_blocks == 64
    assert not engine.has_unfinished()


def test_requests_join_a_running_batch(qwen_engine_factory):
    """A request added mid-generation is decoded in the same steps as the running one (continuous batching)."""
    engine = qwen_engine_factory()
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = _prompts(2, 10)
    alone = [o.token_ids for o in qwen_engine_factory().generate(prompts, greedy)]
    engine.add_request("first", prompts[0], greedy)
    engine.step()
    engine.step()
    engine.add_request("second", prompts[1], greedy)
    tokens = {}
    shared_steps = 0
    while engine.has_unfinished():
        running = {s.request_id for s in engine.scheduler.running}
        outputs = engine.step()
        shared_steps += running == {"first", "second"}
        for o in outputs:
            tokens[o.request_id] = o.token_ids
    assert shared_steps >= 8
    assert [tokens["first"], tokens["second"]] == alone


def test_a_request_that_fits_overtakes_one_that_does_not(qwen_engine_factory):
    """6 blocks, 1 kept free: "running" holds 4 (48 tokens and its next token's slot). "big" needs 4 and waits;
    "small" arrived after it, needs 1 and runs, since "big" would not fit even without it (scheduler.py, 3.)."""
    engine = qwen_engine_factory(num_kv_blocks=6, max_num_batched_tokens=512)
    engine.add_request("running", [7] * 48, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    engine.add_request("big", [7] * 48, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("small", [7] * 4, SamplingParams(max_tokens=2, ignore_eos=True))
    batch = engine.scheduler.schedule()
    assert [s.request_id for s in batch.seqs] == ["small", "running"]  # prefill chunks first, then decodes
    assert [s.request_id for s in engine.scheduler.waiting] == ["big"]


def test_block_table_pool_is_updated_in_place():
    pool = BlockTablePool(max_num_seqs=4, max_blocks_per_seq=8, device=Device("cpu"))
    manager = BlockManager(num_blocks=10, block_size=4, pool=pool)
    storage = pool.tables.data_ptr()
    seq = Sequence("s", [1] * 9, SamplingParams(), 0.0)
    manager.allocate(seq, 9)
    assert pool.flush() == 3
    row = seq.pool_row
    assert pool.tables[row, :3].tolist() == seq.block_table
    assert manager.slot(seq, 5) == seq.block_table[1] * 4 + 1
    manager.allocate(seq, 13)  # one more block: exactly one entry written
    assert pool.flush() == 1
    assert pool.tables[row, :4].tolist() == seq.block_table
    assert pool.tables.data_ptr() == storage
    manager.free(seq)
    assert manager.num_free_blocks == 10 and pool.num_free_rows == 4


def test_kv_block_bytes_counts_k_and_v_of_every_layer(tiny_qwen2_path):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny_qwen2_path)
    # 2 (K,V) * 2 layers * 16 tokens * 2 kv heads * 16 head_dim * 4 bytes
    assert kv_block_bytes(config, 16, torch.float32) == 2 * 2 * 16 * 2 * 16 * 4
