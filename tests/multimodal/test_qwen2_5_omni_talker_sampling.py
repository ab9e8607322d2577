"""The talker's sampled codec tokens against transformers in distribution (issue 27's acceptance: "talker codec ids
... equal in distribution checks otherwise"): our sampler under the released sampling (top-k 40, top-p 0.8,
temperature 0.9, repetition penalty 1.05 over prompt and output ids, codec bos suppressed, the EOS ids ordinary
tokens until drawn) draws from the very distribution transformers' `generate` samples from, which these tests compute
exactly with transformers' own logits processors (`GenerationMixin._get_logits_processor` with the settings
`Qwen2_5OmniForConditionalGeneration.generate` gives its talker), then softmax.

The check (`check_draws`), for n draws of a distribution p:
- support: no draw of a token p gives zero (exact: a token top-k, top-p or the suppression removed);
- chi-square goodness of fit over p's support, p-value >= FALSE_FAILURE (every expected count >= 5, asserted);
- total variation: the L1 distance of the frequencies to p within the Bretagnolle-Huber-Carol bound
  sqrt(2 (k ln 2 + ln(1 / FALSE_FAILURE)) / n) for k support tokens (P(L1 >= bound) <= FALSE_FAILURE).
So a correct sampler fails each check with probability at most 1e-6 over its seeds; the seeds are fixed, so a run
is repeatable, never flaky. Each test also shows the check can fail: the same draws are rejected against the
distribution without the repetition penalty (its effect, 1.05, is the smallest of the settings).
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
from omni_reference import messages, transformers_inputs, transformers_reference
from scipy.stats import chi2
from test_qwen2_5_omni import engine_request, folder, make_engine, ours, prepare  # noqa: F401 (fixtures)
from test_qwen2_5_omni_speech import REPLY, engine_rows, padded

from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampler import Sampler
from omni_backend.engine.sequence import Sequence
from omni_backend.stages.talker import Speakers, TalkerInputs, TalkerSettings, engine_config, thinker_rows

FALSE_FAILURE = 1e-6  # per check, for a sampler that draws from transformers' distribution
DRAWS = 20_000  # per sampler path in the synthetic test
BATCH = 2_000  # rows per sampler call ([2000, 8448] float32: 68 MB)
FIRST_TOKENS = 4_000  # answers whose first codec token the end-to-end test draws


def generate_talker_settings(codec_bos: int) -> dict:
    """What `Qwen2_5OmniForConditionalGeneration.generate` hands its talker's `generate` for sampling: its
    signature's talker_* defaults and `suppress_tokens=[codec_bos]` (modeling_qwen2_5_omni.py, transformers 5)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    defaults = {name[len("talker_"):]: parameter.default for name, parameter
                in inspect.signature(Qwen2_5OmniForConditionalGeneration.generate).parameters.items()
                if name.startswith("talker_") and name != "talker_max_new_tokens"}
    return dict(defaults, suppress_tokens=[codec_bos])


def transformers_probs(talker, history: torch.Tensor, logits: torch.Tensor, settings: dict,
                       attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The next-token distribution float64 [V] transformers' sampling step draws from: its logits processors for
    `settings` (built by the talker's own `_prepare_generation_config` and `_get_logits_processor`, as its
    `generate` builds them) over the ids so far `history` int64 [1, L] and the raw logits [V], then softmax
    (`GenerationMixin._sample`: `probs = softmax(next_token_scores)`, `torch.multinomial(probs)`)."""
    config, _ = talker._prepare_generation_config(None, **settings)
    processors = talker._get_logits_processor(config, input_ids_seq_length=history.shape[1], device="cpu",
                                              model_kwargs={"attention_mask": attention_mask})
    scores = processors(history, logits.float().reshape(1, -1).clone())
    return scores.softmax(dim=-1)[0].double()


def check_draws(tokens: list[int], probs: torch.Tensor) -> tuple[int, float, float, float]:
    """(draws outside p's support, chi-square p-value, L1 distance, its bound) of `tokens` against `probs`
    (module docstring)."""
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    support = probs > 0
    expected = probs[support] * n
    assert expected.min() >= 5, "too few draws for the chi-square approximation"
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    p_value = float(chi2.sf(statistic, df=int(support.sum()) - 1))
    l1 = float((counts / n - probs).abs().sum())
    bound = math.sqrt(2 * (int(support.sum()) * math.log(2) + math.log(1 / FALSE_FAILURE)) / n)
    return int(counts[~support].sum()), p_value, l1, bound


def assert_same_distribution(tokens: list[int], probs: torch.Tensor) -> None:
    outside, p_value, l1, bound = check_draws(tokens, probs)
    assert outside == 0
    assert p_value >= FALSE_FAILURE, (p_value, l1, bound)
    assert l1 <= bound, (p_value, l1, bound)


def assert_rejected(tokens: list[int], probs: torch.Tensor) -> None:
    outside, p_value, l1, bound = check_draws(tokens, probs)
    assert outside > 0 or p_value < FALSE_FAILURE, (p_value, l1, bound)


@pytest.fixture(scope="module")
def talker(folder):
    """transformers' talker of the tiny checkpoint's config (its processors read only its generation config)."""
    from transformers import AutoConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniTalkerForConditionalGeneration

    return Qwen2_5OmniTalkerForConditionalGeneration._from_config(AutoConfig.from_pretrained(folder).talker_config)


def synthetic_logits(inputs: TalkerInputs, vocab: int, shift: float) -> tuple[torch.Tensor, list[int]]:
    """Raw logits [V] where every setting changes the distribution, and the talker's ids so far: the prompt's
    (codec mask x 6, codec pad, codec bos) and 12 codec tokens.

    60 head tokens of logits evenly from 6 to 5 over a tail near -4: top-k 40 cuts the head, then top-p 0.8 cuts
    the 40 (about 32 stay; without top-k about 48 would). Codec bos above them all (suppressed, else the likeliest
    token), both EOS ids near the top of the head (codec pad also in the prompt, so penalized), and six head tokens
    in the history, two of them just inside the top 40 (the penalty moves them out and lets others in). `shift`
    moves every logit: softmax ignores it, the repetition penalty does not (it divides positive logits, multiplies
    negative ones).
    """
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(vocab, generator=generator) * 0.5 - 4.0
    special = torch.tensor([inputs.codec_bos, inputs.codec_pad, inputs.codec_end, inputs.codec_mask])
    head = torch.randperm(vocab, generator=generator)[:70]
    head = head[~torch.isin(head, special)][:58]
    head = torch.cat([head[:3], torch.tensor([inputs.codec_pad]), head[3:9], torch.tensor([inputs.codec_end]),
                      head[9:]])
    logits[head] = torch.linspace(6.0, 5.0, head.numel())
    logits[inputs.codec_bos] = 7.0
    outputs = [int(t) for t in head[[0, 2, 5, 11, 36, 38, 5, 0, 2, 11, 0, 50]]]
    history = [inputs.codec_mask] * 6 + [inputs.codec_pad, inputs.codec_bos] + outputs
    return logits + shift, history


def our_draws(inputs: TalkerInputs, logits: torch.Tensor, history: list[int], seeded: bool) -> list[int]:
    """DRAWS tokens of our sampler, BATCH rows per call of equal logits and history: seeded rows (seeds 0..DRAWS-1,
    each its own generator, as the talker's answers are) or unseeded ones (the global generator, seeded here)."""
    torch.manual_seed(0)
    tokens = []
    for first in range(0, DRAWS, BATCH):
        seqs = [Sequence(str(i), history, inputs.sampling(TalkerSettings(), seed=i if seeded else None), 0.0)
                for i in range(first, first + BATCH)]
        tokens += Sampler()(logits.expand(BATCH, -1), seqs).token_ids
    return tokens


@pytest.mark.parametrize("shift", [0.0, -13.0], ids=["positive", "negative"])
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_sampled_codec_tokens_follow_transformers_distribution(folder, talker, shift, seeded):
    """20,000 draws of our sampler under the talker's sampling (`TalkerInputs.sampling`) on logits and a history
    where top-k, top-p, the penalty (positive and negative logits) and the suppression all matter pass
    `check_draws` against transformers' distribution (30 tokens kept; seen: L1 0.033-0.037 against the bound 0.059,
    p-values 0.03-0.5), and fail it against the distribution without the penalty (seen: L1 0.09, p below 1e-40)."""
    inputs = TalkerInputs(folder, Speakers.load(folder))
    settings = generate_talker_settings(inputs.codec_bos)
    logits, history = synthetic_logits(inputs, talker.config.vocab_size, shift)
    ids = torch.tensor([history])
    probs = transformers_probs(talker, ids, logits, settings)
    kept = probs > 0
    assert 25 <= int(kept.sum()) < 40 and probs[inputs.codec_bos] == 0 and probs[inputs.codec_end] > 0.01
    # no token within float rounding of the top-p cut (else the support could differ by rounding alone)
    ordered = probs.sort(descending=True).values
    unpruned = transformers_probs(talker, ids, logits, dict(settings, top_p=1.0)).sort(descending=True).values
    before = unpruned.cumsum(0) - unpruned
    assert (before[:40] - settings["top_p"]).abs().min() > 1e-3 and ordered[0] < 0.5

    tokens = our_draws(inputs, logits, history, seeded)
    assert_same_distribution(tokens, probs)
    assert_rejected(tokens, transformers_probs(talker, ids, logits, dict(settings, repetition_penalty=1.0)))


class _Captured(Exception):
    """Stops transformers' `generate` once its talker's first step is recorded."""


def transformers_first_step(model, inputs, voice: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """What transformers' `generate` gives its talker's first sampling step: the talker's ids [1, L] and attention
    mask, its raw logits [V] and the sampling settings `generate` passed (the talker's `generate` is run for one
    greedy step with `output_logits`, then the whole `generate` is stopped). The prompt goes in padded as
    test_qwen2_5_omni_speech.transformers_speech explains."""
    talker = model.talker
    real = talker.generate
    seen = {}

    def first_step(*args, **kwargs):
        kwargs = {key: value for key, value in kwargs.items() if key not in ("pixel_values", "pixel_values_videos")}
        out = real(*args, **dict(kwargs, max_new_tokens=1, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True))
        seen.update(ids=kwargs["input_ids"], mask=kwargs["attention_mask"], logits=out.logits[0][0],
                    settings={key: kwargs[key] for key in ("do_sample", "top_k", "top_p", "temperature",
                                                           "repetition_penalty", "eos_token_id", "suppress_tokens")})
        raise _Captured

    talker.generate = first_step
    try:
        with torch.no_grad(), pytest.raises(_Captured):
            model.generate(**padded(inputs), speaker=voice, thinker_max_new_tokens=REPLY, thinker_do_sample=False)
    finally:
        del talker.generate  # the class's method again
    return seen["ids"], seen["mask"], seen["logits"], seen["settings"]


def test_first_codec_tokens_of_a_spoken_answer_follow_transformers_distribution(folder, ours):
    """End to end on the tiny checkpoint: our thinker's rows, our talker prompt and engine, sampled as served
    (`TalkerInputs.sampling`, a seed per answer): the first codec tokens of 4,000 answers to one text question
    pass `check_draws` against the distribution of transformers' `generate` for that answer (its talker's logits
    through its processors, with the settings `generate` passes: those the talker is served with; 32 tokens kept,
    seen: L1 0.086 against the bound 0.134, p-value 0.15)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    processor, _ = transformers_reference(folder)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    voice = "Chelsie"
    ids, mask, logits, settings = transformers_first_step(model, transformers_inputs(processor, "text"), voice)
    assert settings["do_sample"] is True
    probs = transformers_probs(model.talker, ids, logits, settings, mask)
    assert int((probs > 0).sum()) > 5 and float(probs.max()) < 0.5

    inputs = TalkerInputs(folder, Speakers.load(folder))
    request = engine_request(*prepare(ours, messages("text")))
    count = len(request["prompt_token_ids"])
    _, hidden, embeds = engine_rows(make_engine(folder), [request])[0]
    rows = thinker_rows(torch.from_numpy(hidden), torch.from_numpy(embeds))
    prompt_ids, prompt, positions = inputs.prompt(voice, rows[:count], rows[count], None)
    assert prompt_ids == ids[0, 1:].tolist()  # transformers' ids after its pad
    engine = LLMEngine(engine_config(folder, TalkerSettings(max_num_seqs=256, max_model_len=256), device="cpu",
                                     dtype="float32"))
    for seed in range(FIRST_TOKENS):
        engine.add_request(f"a{seed}", prompt_ids, inputs.sampling(TalkerSettings(), seed, max_tokens=1), prompt,
                           positions, inputs.addends())
    tokens = []
    while engine.has_unfinished():
        tokens += [output.token_ids[0] for output in engine.step() if output.finished]
    assert len(tokens) == FIRST_TOKENS
    assert_same_distribution(tokens, probs)
    assert np.unique(tokens).size > 5
