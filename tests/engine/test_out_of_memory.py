"""A step that runs out of device memory (injected on CPU) is retried with half the token budget and loses
nothing; only a one-token step that still runs out is raised."""

from __future__ import annotations

import logging

import pytest
import torch

from omni_backend.engine import scheduler as scheduler_module
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams


def _config(path: str) -> EngineConfig:
    return EngineConfig(model_path=path, dtype="float32", num_kv_blocks=32, block_size=16, max_num_seqs=4,
                        max_num_batched_tokens=32, max_model_len=128)


def _fail_calls(monkeypatch, runner, calls: set[int]) -> list[int]:
    """Make the model's forward raise torch.OutOfMemoryError on the given (1-based) calls."""
    forward = runner.model.forward
    seen = []

    def failing(*args, **kwargs):
        seen.append(len(seen) + 1)
        if seen[-1] in calls:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner.model, "forward", failing)
    return seen


def test_an_out_of_memory_step_is_retried_with_half_the_budget_and_loses_nothing(tiny_qwen2_path, monkeypatch,
                                                                                 caplog):
    prompts = [list(range(100, 140)), list(range(300, 310)), [7, 8, 9]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLMEngine(_config(tiny_qwen2_path)).generate(prompts, params)]

    monkeypatch.setattr(scheduler_module, "BUDGET_RESTORE_STEPS", 3)
    engine = LLMEngine(_config(tiny_qwen2_path))
    calls = _fail_calls(monkeypatch, engine.runner, {1, 6})  # the first prefill step, and a later step
    budgets = []
    for request_id, prompt in enumerate(prompts):
        engine.add_request(str(request_id), prompt, params)
    finals = {}
    with caplog.at_level(logging.WARNING, logger="omni_backend.engine.llm_engine"):
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            budgets.append(engine.scheduler.token_budget)
    assert [finals[str(i)].token_ids for i in range(3)] == expected
    assert engine.num_oom_recoveries == 2 and len(calls) > 6
    assert budgets[0] == 16  # halved after the first step failed
    assert budgets[-1] == 32  # and restored after successful steps
    assert "out of device memory in a step of 32 tokens" in caplog.text
    assert engine.runner.block_manager.num_free_blocks == 32  # nothing leaked


def test_an_out_of_memory_one_token_step_is_raised(tiny_qwen2_path, monkeypatch):
    engine = LLMEngine(_config(tiny_qwen2_path))
    engine.scheduler.token_budget = 1
    _fail_calls(monkeypatch, engine.runner, {1})
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(torch.OutOfMemoryError):
        engine.step()
