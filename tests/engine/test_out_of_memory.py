"""A step that runs out of device memory (injected on CPU) is retried with half the token budget and loses
nothing, seeded draws included; only a one-token step that still runs out is raised."""

from __future__ import annotations

import logging

import pytest
import torch

from omni_backend.engine import sampler as sampler_module
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


def test_seeded_sampling_after_an_out_of_memory_retry_draws_the_same_tokens(tiny_qwen2_path, monkeypatch):
    """The injected OOM strikes inside the sampler, after the seeded rows' noise was drawn (their generators had
    advanced by a vocabulary of draws, one of them made in that very step): the retried steps restore the state and
    every request's tokens are those of a run without the fault."""
    prompts = [list(range(100, 140)), list(range(300, 310)), [7, 8, 9]]
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.7, seed=12, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=1.0, top_k=40, seed=13, ignore_eos=True)]
    expected = [o.token_ids for o in LLMEngine(_config(tiny_qwen2_path)).generate(prompts, params)]

    noise_init = sampler_module._SeededNoise.__init__
    calls = []

    def failing_noise(self, *args, **kwargs):
        noise_init(self, *args, **kwargs)  # the generators advance here
        calls.append(len(calls) + 1)
        if calls[-1] in (1, 4):  # the first step (generators made in it) and a decode step
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected)")

    monkeypatch.setattr(sampler_module._SeededNoise, "__init__", failing_noise)
    engine = LLMEngine(_config(tiny_qwen2_path))
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert engine.num_oom_recoveries == 2 and len(calls) > 4
    assert got == expected
