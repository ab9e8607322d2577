"""Prompt embeddings (encoder outputs at placeholder positions) replace token embeddings exactly."""

from __future__ import annotations

import pytest
import torch

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import PromptEmbeds

PLACEHOLDER = 7


@pytest.mark.parametrize("step_budget,num_blocks", [(256, 64), (3, 64), (8, 4)])
def test_embeds_at_placeholders_equal_the_tokens_they_stand_for(tiny_qwen2_path, step_budget, num_blocks):
    """[a, P, P, P, b...] with embeddings of [x, y, z] at the P positions decodes like [a, x, y, z, b...],
    also when chunked prefill splits the placeholders (budget 3) and under preemption (4 blocks)."""
    engine = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=num_blocks,
                                    max_num_seqs=4, max_num_batched_tokens=max(step_budget, 4),
                                    max_model_len=64))
    plain = [101, 2001, 2002, 2003] + list(range(300, 320))
    with_placeholders = [101, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER] + list(range(300, 320))
    stand_in = engine.runner.model.embed_tokens.weight[[2001, 2002, 2003]].detach().clone()
    embeds = PromptEmbeds(torch.tensor([1, 2, 3]), stand_in)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)

    def signature(output):  # tokens and their logprobs: a random tiny model repeats tokens, logprobs differ
        return [(lp.token_id, round(lp.logprob, 4)) for lp in output.logprobs]

    expected = signature(engine.generate([plain], params)[0])
    engine.add_request("mm", with_placeholders, params, prompt_embeds=embeds)
    engine.add_request("other", list(range(400, 420)), params)  # batched with a text-only request
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert signature(finals["mm"]) == expected
    without = signature(engine.generate([with_placeholders], params)[0])
    assert without != expected  # the replacement really changed the input


def test_bad_prompt_embeds_are_rejected(tiny_qwen2_path):
    engine = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=16,
                                    max_model_len=64))
    with pytest.raises(ValueError, match="positions must lie"):
        engine.add_request("a", [1, 2], SamplingParams(), PromptEmbeds(torch.tensor([5]), torch.zeros(1, 64)))
    with pytest.raises(ValueError, match="must be"):
        engine.add_request("b", [1, 2], SamplingParams(), PromptEmbeds(torch.tensor([0, 1]), torch.zeros(1, 64)))
