"""Non-finite logits (NaN, +inf, a row without a finite value) fail only their own row in the sampler and only their
own request in the engine; every index the sampler draws stays inside the vocabulary (on CUDA an index past the end
is a device-side assert that ends the whole stage; on the CPU, before the guard, an IndexError failed the step)."""

from __future__ import annotations

import pytest
import torch

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import NON_FINITE_LOGITS, LLMEngine
from omni_backend.engine.sampler import Sampler
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import Sequence
from omni_backend.stages.llm.core import EngineCore
from omni_backend.vocabulary import ErrorKind, StageError

VOCAB = 4096
NAN, INF = float("nan"), float("inf")

# One row per way a row is drawn (sampler.py): greedy, unseeded in token order (no truncation), unseeded ranked
# (top-p over the candidates), seeded with top-k, seeded top-p without top-k (the whole-vocabulary mass), seeded
# without truncation (the full sort).
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9),
    SamplingParams(temperature=0.9, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=20, seed=3),
    SamplingParams(temperature=0.8, top_p=0.95, seed=4),
    SamplingParams(temperature=1.0, seed=5),
]


def _seqs(params: list[SamplingParams]) -> list[Sequence]:
    return [Sequence(f"r{i}", [1, 2, 3], p, 0.0) for i, p in enumerate(params)]


def _poison(row: torch.Tensor, how: str) -> None:
    if how == "nan row":
        row.fill_(NAN)
    elif how == "one nan":
        row[VOCAB // 3] = NAN
    elif how == "plus inf":
        row[7] = INF
    else:  # "no finite value"
        row.fill_(-INF)


@pytest.mark.parametrize("how", ["nan row", "one nan", "plus inf", "no finite value"])
@pytest.mark.parametrize("bad", range(len(PARAMS)))
def test_a_row_with_non_finite_logits_fails_alone_and_draws_inside_the_vocabulary(how, bad):
    gen = torch.Generator().manual_seed(bad)
    logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * 3
    clean = Sampler()(logits, _seqs(PARAMS))
    poisoned = logits.clone()
    _poison(poisoned[bad], how)
    for _ in range(3):  # unseeded draws are random: several tries at the index past the end
        result = Sampler()(poisoned, _seqs(PARAMS))
        assert result.failed == [bad]
        assert all(0 <= t < VOCAB for t in result.token_ids)
        deterministic = [i for i, p in enumerate(PARAMS) if i != bad and (p.greedy or p.seed is not None)]
        assert [result.token_ids[i] for i in deterministic] == [clean.token_ids[i] for i in deterministic]
    assert clean.failed == []


def test_logprob_rows_with_nan_logits_fail_too():
    logits = torch.randn(2, VOCAB)
    logits[1] = NAN
    params = [SamplingParams(temperature=0.0, logprobs=3)] * 2
    result = Sampler()(logits, _seqs(params))
    assert result.failed == [1] and result.token_ids[0] == int(logits[0].argmax())
    assert result.logprobs[0][0] == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-5)


def test_the_engine_ends_only_the_request_whose_logits_are_nan(tiny_qwen2_path):
    """Through the llm stage's engine loop: request b's row of logits turns NaN at its third token; b ends with an
    INTERNAL error naming the cause, a and c finish with the tokens of a run without the fault, and the next
    request still works."""
    config = EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=64, max_model_len=256)
    prompts = {"a": [5, 6, 7, 8], "b": list(range(100, 120)), "c": [9, 10]}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = dict(zip(prompts, (o.token_ids for o in LLMEngine(config).generate(list(prompts.values()), params))))

    engine = LLMEngine(config)
    sample = engine.runner.sampler

    def poisoning(logits, seqs):
        logits = logits.clone()
        for row, seq in enumerate(seqs):
            if seq.request_id == "b" and seq.num_output_tokens == 2:
                logits[row] = NAN
        return sample(logits, seqs)

    engine.runner.sampler = poisoning
    core = EngineCore(engine)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    results: dict[str, list] = {}
    while engine.has_unfinished():
        core.run_once()
        while not core.outbox.empty():
            request_id, item = core.outbox.get()
            results.setdefault(request_id, []).append(item)
    error = results["b"][-1]
    assert isinstance(error, StageError) and error.kind is ErrorKind.INTERNAL
    assert error.message == f"llm failed: {NON_FINITE_LOGITS}"
    for request_id in ("a", "c"):
        assert results[request_id][-1].finish_reason == "length"
        assert results[request_id][-1].token_ids == expected[request_id]
    assert engine.runner.block_manager.num_free_blocks == 64  # b's blocks were freed with it
    again = engine.generate([prompts["b"]], params)[0]
    assert again.token_ids == expected["b"]
