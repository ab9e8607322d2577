"""Sampling settings, seeds, penalties, stop strings, logprobs and UTF-8-safe streaming; the sampler on the
logits' device against the pre-#14 CPU sampler kept in tests/engine/sampler_reference.py (same seeded tokens)."""

from __future__ import annotations

import random

import pytest
import torch
from sampler_reference import Sampler as ReferenceSampler

from omni_backend.engine import sampler as sampler_module
from omni_backend.engine import sampling_ops
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.detokenizer import IncrementalDetokenizer
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampler import Sampler, apply_penalties
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import Sequence

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.fixture(scope="module")
def engine(smollm2_path) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=smollm2_path, dtype="float32", kv_cache_bytes=64 << 20,
                                  max_model_len=512))


def _chat(engine, text):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]


def _stream(engine, request_id, prompt, params):
    engine.add_request(request_id, prompt, SamplingParams(**{**params.__dict__, "stream": True}))
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out)
            final = out
    return deltas, final


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", -5), ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0.0),
    ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("logprobs", 21), ("seed", -1), ("temperature", float("nan")),
])
def test_out_of_range_values_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_top_p_one_and_edge_values_are_accepted():
    SamplingParams(top_p=1.0, presence_penalty=2.0, frequency_penalty=-2.0, temperature=0.0, logprobs=20)


def test_same_seed_same_output_different_seed_different_output(engine):
    prompt = _chat(engine, "Tell me a story about a dragon.")
    p = dict(max_tokens=24, temperature=1.0, top_p=0.95)
    a, b, c = engine.generate([prompt] * 3, [SamplingParams(seed=7, **p), SamplingParams(seed=7, **p),
                                             SamplingParams(seed=8, **p)])
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_1_equals_greedy(engine):
    prompt = _chat(engine, "Name three fruits.")
    greedy, top1 = engine.generate([prompt, prompt], [SamplingParams(max_tokens=16, temperature=0.0),
                                                      SamplingParams(max_tokens=16, temperature=1.5, top_k=1,
                                                                     seed=3)])
    assert greedy.token_ids == top1.token_ids


def test_a_temperature_too_small_to_divide_by_is_greedy(engine):
    """1.1e-38 (found by the fuzz test) made logits / T overflow to inf and the step fail; below 1e-5 is greedy."""
    prompt = _chat(engine, "Name three fruits.")
    greedy, tiny = engine.generate([prompt, prompt], [SamplingParams(max_tokens=16, temperature=0.0),
                                                      SamplingParams(max_tokens=16, temperature=1.1313586865527403e-38)])
    assert (tiny.token_ids, tiny.finish_reason) == (greedy.token_ids, greedy.finish_reason)
    assert SamplingParams(temperature=1e-5).greedy is False


def test_sampler_respects_top_k_top_p_min_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(1000, 1)
    sampler = Sampler()

    def draw(**kw):
        seqs = [Sequence(str(i), [1], SamplingParams(seed=i, **kw), 0.0) for i in range(1000)]
        return set(sampler(logits, seqs).token_ids)

    assert draw(top_k=2) == {0, 1}
    # softmax of [4,3,2,1,0]: 0.636, 0.234, 0.086, ... -> top_p 0.8 keeps the first two
    assert draw(top_p=0.8) == {0, 1}
    assert draw(min_p=0.3) == {0, 1}  # 0.086 < 0.3 * 0.636
    assert draw() == {0, 1, 2, 3, 4}


def test_penalties_change_logits_as_specified():
    seq = Sequence("p", [1, 2], SamplingParams(repetition_penalty=2.0, presence_penalty=0.5,
                                               frequency_penalty=0.25), 0.0)
    seq.token_ids += [3, 3]  # two generated tokens, both 3
    plain = Sequence("q", [1, 2], SamplingParams(), 0.0)
    logits = torch.tensor([[1.0, 2.0, -2.0, 4.0, 1.0], [1.0, 2.0, -2.0, 4.0, 1.0]])
    penalized = apply_penalties(logits, [seq, plain])
    # ids 1,2,3 seen: positive /2, negative *2; id 3 also gets presence 0.5 + frequency 0.25*2
    assert penalized[0].tolist() == [1.0, 1.0, -4.0, 2.0 - 0.5 - 0.5, 1.0]
    assert penalized[1].tolist() == [1.0, 2.0, -2.0, 4.0, 1.0]  # no penalty asked
    assert logits[0].tolist() == [1.0, 2.0, -2.0, 4.0, 1.0]  # the input is not modified


def test_suppressed_tokens_are_never_sampled_greedy_or_not():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(200, 1)
    seqs = [Sequence(str(i), [1], SamplingParams(seed=i, suppress_token_ids=[0, 2]), 0.0) for i in range(199)]
    seqs.append(Sequence("greedy", [1], SamplingParams(temperature=0.0, suppress_token_ids=[0]), 0.0))
    tokens = Sampler()(logits, seqs).token_ids
    assert set(tokens[:-1]) == {1, 3, 4} and tokens[-1] == 1
    assert apply_penalties(logits[:1], seqs[:1])[0].tolist() == [float("-inf"), 3.0, float("-inf"), 1.0, 0.0]


def test_vectorized_penalties_equal_the_reference_bit_for_bit():
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 3000, generator=gen) * 4
    seqs = []
    for row in range(12):
        params = SamplingParams(repetition_penalty=rng.choice([1.0, 1.1, 0.7, 1.37]),
                                presence_penalty=rng.choice([0.0, 0.3, -1.1]),
                                frequency_penalty=rng.choice([0.0, 0.1, 1.7]))
        seq = Sequence(str(row), [rng.randrange(3000) for _ in range(rng.randrange(1, 50))], params, 0.0)
        seq.token_ids += [rng.randrange(40) for _ in range(rng.randrange(0, 60))]  # repeats among 40 ids
        seqs.append(seq)
    expected = logits.clone()
    for row, seq in enumerate(seqs):
        ReferenceSampler._apply_penalties(expected[row], seq)
    assert not torch.equal(expected, logits)
    assert torch.equal(apply_penalties(logits, seqs), expected)


def test_stop_string_text_is_never_streamed(engine):
    prompt = engine.tokenizer("The alphabet: ABC")["input_ids"]
    full, = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))
    assert "DEFGHIJ" in full.text, full.text  # the model continues the alphabet
    params = SamplingParams(max_tokens=20, temperature=0.0, stop=["DEFGHIJ"])
    deltas, final = _stream(engine, "stop", prompt, params)
    joined = "".join(d.text for d in deltas)
    assert final.finish_reason == "stop"
    assert joined == full.text[:full.text.index("DEFGHIJ")]
    for d in deltas:
        assert not any(ch in d.text for ch in "DEFGHIJ")
    non_stream, = engine.generate([prompt], params)
    assert non_stream.text == joined


def test_streamed_cjk_and_emoji_never_split(engine):
    prompt = _chat(engine, "Repeat exactly: 你好世界 🌶️ 再见")
    params = SamplingParams(max_tokens=40, temperature=0.0)
    deltas, final = _stream(engine, "cjk", prompt, params)
    assert all("\ufffd" not in d.text for d in deltas)
    joined = "".join(d.text for d in deltas)
    whole, = engine.generate([prompt], params)
    assert joined == whole.text
    assert joined.encode("utf-8") == engine.tokenizer.decode(whole.token_ids, skip_special_tokens=True).encode()


def test_detokenizer_holds_back_partial_utf8(smollm2_path):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tokenizer("🌶️ 你好", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [1], stop=[])
    pieces = []
    for token in ids:
        detok.add_token(token)
        pieces.append(detok.release(final=False))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.release(final=True) == "🌶️ 你好"
    assert len(ids) > len("🌶️ 你好")  # the text really spans multi-token characters


def test_logprobs_are_consistent(engine):
    prompt = _chat(engine, "Say yes.")
    out, = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3))
    assert len(out.logprobs) == len(out.token_ids)
    for entry in out.logprobs:
        assert len(entry.top) == 3
        top_ids = [i for i, _ in entry.top]
        assert entry.token_id == top_ids[0]  # greedy picks the most likely token
        assert entry.logprob == pytest.approx(entry.top[0][1])
        assert entry.logprob <= 0


class CharTokenizer:
    """One token per character (id = code point): enough to test stop-string handling exactly."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("stops,text,expected", [
    (["b", "a"], "xab", "x"),            # earliest match wins, whatever the list order
    (["cd", "bcx"], "abcd", "ab"),       # a held-back prefix of one stop that turns into another
    (["zz"], "abz", "abz"),              # no match: everything is released at the end
])
def test_stop_strings_cut_at_the_earliest_match(stops, text, expected):
    detok = IncrementalDetokenizer(CharTokenizer(), [ord(">")], stop=stops)
    released, stopped = "", False
    for ch in text:
        stopped = detok.add_token(ord(ch))
        released += detok.release(final=stopped)
        if stopped:
            break
    if not stopped:
        released += detok.release(final=True)
    assert released == expected
    assert not any(stop in released for stop in stops)


def test_prompt_logprobs_score_each_prompt_token_like_a_sampled_one(engine, smollm2_path):
    """prompt_logprobs: one entry per prompt token, the first without a logprob; the last prompt token's logprob
    equals the logprob the engine reports when it samples that same token after the same prefix, and a prefill
    cut into chunks of 7 tokens gives the same values."""
    prefix = _chat(engine, "Name a fruit.")
    greedy = engine.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0, logprobs=0))[0]
    prompt = prefix + greedy.token_ids
    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    entries = out.prompt_logprobs
    assert [e.token_id for e in entries] == prompt
    assert entries[0].logprob is None and entries[0].top == []
    assert all(e.logprob <= 0 and len(e.top) == 2 for e in entries[1:])
    assert entries[-1].logprob == pytest.approx(greedy.logprobs[0].logprob, abs=1e-4)
    assert entries[-1].top[0][0] == prompt[-1]  # the greedy token is its own top alternative
    chunked = LLMEngine(EngineConfig(model_path=smollm2_path, dtype="float32", kv_cache_bytes=16 << 20,
                                     max_model_len=512, max_num_seqs=4, max_num_batched_tokens=7))
    again = chunked.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    assert [e.token_id for e in again.prompt_logprobs] == prompt
    assert [e.logprob for e in again.prompt_logprobs[1:]] == pytest.approx([e.logprob for e in entries[1:]],
                                                                           abs=1e-4)
    plain = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert plain.prompt_logprobs is None


# ---- the sampler on the logits' device against the pre-#14 reference (tests/engine/sampler_reference.py) ----

QUESTIONS = [
    "Tell me a story about a dragon.", "What is the capital of France?", "Write a haiku about autumn leaves.",
    "Explain how a transistor works.", "Give me three ideas for a birthday party.", "What is 17 times 23?",
    "Describe your ideal vacation.", "Write a product description for a water bottle.", "Who painted the Mona Lisa?",
    "Suggest a name for a coffee shop.", "How do I boil an egg?", "Write a limerick about a cat.",
    "What causes rain?", "List five animals that live in the ocean.", "Translate 'thank you' into German.",
    "Why do we dream?", "Write the opening line of a mystery novel.", "What is a prime number?",
    "Give me a motivational quote.", "How does a bicycle stay upright?", "Invent a new holiday and describe it.",
    "What is the tallest mountain on Earth?", "Write a short poem about the moon.", "Explain recursion to a child.",
    "What should I cook for dinner tonight?", "Describe the color blue without naming it.",
    "What are the benefits of exercise?", "Write a tweet announcing a new smartphone.", "What is photosynthesis?",
    "Tell me a joke about computers.", "How many legs does a spider have?", "Write a thank-you note to a teacher.",
]


@pytest.fixture(scope="module")
def smollm2_steps(smollm2_path) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Real SmolLM2 next-token logits for 32 chat prompts and the next 3 steps of sampled continuations
    (4 float32 [32, 49152] tensors), with the prompts' token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in QUESTIONS]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, max_new_tokens=4, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
    return [step.float() for step in out.logits], prompts


@pytest.fixture
def passes(monkeypatch) -> list[tuple[int, int]]:
    """(rows, candidates) of every ranked pass the sampler makes; candidates == vocabulary is the full sort."""
    seen = []
    real = sampler_module._Draw._pass

    def spy(self, rows, k):
        seen.append((len(rows), k))
        return real(self, rows, k)

    monkeypatch.setattr(sampler_module._Draw, "_pass", spy)
    return seen


def _twins(params: list[SamplingParams], prompts: list[list[int]]) -> tuple[list[Sequence], list[Sequence]]:
    """The same requests twice: for the sampler under test, and for the reference with the CPU generator that
    Sequence.__init__ made before #14."""
    ours = [Sequence(str(i), prompt, p, 0.0) for i, (p, prompt) in enumerate(zip(params, prompts))]
    theirs = [Sequence(str(i), prompt, p, 0.0) for i, (p, prompt) in enumerate(zip(params, prompts))]
    for seq in theirs:
        if seq.params.seed is not None:
            seq.generator = torch.Generator().manual_seed(seq.params.seed)
    return ours, theirs


def _assert_same_as_reference(steps: list[torch.Tensor], ours: list[Sequence], theirs: list[Sequence]) -> int:
    """Sample each step with both samplers; each sequence gets its own sampler's token. Seeded and greedy rows:
    the same token. Rows asking for logprobs: the chosen token's logprob and the top-n, within float32 rounding
    (1e-5; the reference's log_softmax is off by up to 1.1e-5 on these logits on an AVX-512 Intel Xeon and by
    2.03e-5 on an AVX2-only AMD EPYC, ours by 2e-6) of a float64 log_softmax, the same top-n values as the
    reference within 3e-5, ids that carry them (among equal values the order of ids is free). Returns how many seeded or greedy rows were compared."""
    compared = 0
    for logits in steps:
        got = Sampler()(logits, ours)
        want = ReferenceSampler()(logits, theirs)
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        for row, seq in enumerate(ours):
            if seq.params.seed is not None or seq.params.greedy:
                assert got.token_ids[row] == want.token_ids[row], (row, seq.params)
                compared += 1
            if seq.params.logprobs is not None:
                chosen, top = got.logprobs[row]
                assert chosen == pytest.approx(log_probs[row, got.token_ids[row]].item(), abs=1e-5)
                assert [v for _, v in top] == pytest.approx([log_probs[row, t].item() for t, _ in top], abs=1e-5)
                assert [v for _, v in top] == pytest.approx([v for _, v in want.logprobs[row][1]], abs=3e-5)
                assert len({t for t, _ in top}) == len(top)
            else:
                assert got.logprobs[row] is None
            seq.token_ids.append(got.token_ids[row])
            theirs[row].token_ids.append(want.token_ids[row])
    return compared


def _mixed_params(rng: random.Random, rows: int, vocab: int) -> list[SamplingParams]:
    """Mostly seeded rows mixing temperatures, top-k (up to vocab / 3), top-p, min-p, penalties and logprobs,
    with greedy (temperature 0 or top_k 1) and unseeded rows among them."""
    out = []
    for _ in range(rows):
        kw = {"seed": rng.randrange(2**31) if rng.random() < 0.85 else None,
              "temperature": rng.choice([0.0, 0.5, 0.8, 1.0, 1.0, 1.3])}
        if rng.random() < 0.4:
            kw["top_k"] = rng.choice([1, 5, 20, 50, 100, 300, vocab // 3])
        if rng.random() < 0.6:
            kw["top_p"] = rng.choice([0.5, 0.8, 0.9, 0.95, 0.99])
        if rng.random() < 0.3:
            kw["min_p"] = rng.choice([0.01, 0.05, 0.2])
        if rng.random() < 0.25:
            kw["repetition_penalty"] = rng.choice([1.1, 1.3, 0.8])
        if rng.random() < 0.25:
            kw["presence_penalty"] = rng.choice([0.5, -0.4])
            kw["frequency_penalty"] = rng.choice([0.2, 1.1])
        if rng.random() < 0.3:
            kw["logprobs"] = rng.choice([0, 1, 5])
        out.append(SamplingParams(**kw))
    return out


def test_seeded_rows_equal_the_reference_on_real_logits(smollm2_steps, passes):
    steps, prompts = smollm2_steps
    rng = random.Random(14)
    compared = 0
    for _ in range(4):
        params = _mixed_params(rng, len(prompts), steps[0].shape[1])
        compared += _assert_same_as_reference(steps, *_twins(params, prompts))
    assert compared > 400
    levels = sorted({k for _, k in passes})
    # first passes, rows redone with GROWTH times their candidates, and the full sort all took part
    assert levels[-1] == 49152 and any(k * sampler_module.GROWTH in levels for k in levels)


@pytest.mark.parametrize("scale", [8.0, 2.0, 0.5, 0.05])
def test_seeded_rows_equal_the_reference_on_synthetic_logits(scale, passes):
    """Peaked (scale 8) to nearly flat (0.05) normal logits over 8192 tokens; in half of the rows the logits
    are rounded to quarters, so many tokens share a value and the order among equal values matters."""
    gen = torch.Generator().manual_seed(int(scale * 100))
    steps = []
    for _ in range(3):
        logits = torch.randn(48, 8192, generator=gen) * scale
        logits[24:] = (logits[24:] * 4).round() / 4
        steps.append(logits)
    params = _mixed_params(random.Random(int(scale * 100)), 48, 8192)
    prompts = [torch.randint(0, 8192, (12,), generator=gen).tolist() for _ in range(48)]
    assert _assert_same_as_reference(steps, *_twins(params, prompts)) > 100
    assert any(k == 8192 for _, k in passes)


def test_seeded_top_p_on_the_references_own_cumulative_masses(smollm2_steps, passes):
    """top_p set exactly to a mass the reference computes before rank 1, 2 or 3 (float32, over its sorted row),
    where the reference drops that rank and our normalizer, rounded differently, might keep it: such rows are
    redone with the full sort, and all 192 seeded rows give the reference's tokens."""
    logits = smollm2_steps[0][0][:16]
    probs = torch.softmax(logits.sort(dim=-1, descending=True).values, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    rows, params = [], []
    for row in range(16):
        for rank in (1, 2, 3):
            for seed in range(4):
                rows.append(row)
                params.append(SamplingParams(top_p=mass_before[row, rank].item(), seed=seed))
    assert _assert_same_as_reference([logits[rows]], *_twins(params, [[1]] * len(rows))) == len(rows)
    assert any(k == logits.shape[1] for _, k in passes)


def _truncated_distribution(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """float64 [V]: the probability of each token for a sampled row without penalties: softmax(x / T) over the
    top_k best, then the top-p prefix and the min-p floor, renormalized."""
    probs, order = torch.softmax(row.double() / p.temperature, dim=-1).sort(descending=True)
    k = p.top_k if 0 < p.top_k < row.numel() else row.numel()
    probs[k:] = 0.0
    probs /= probs.sum()
    keep = ((probs.cumsum(0) - probs) < p.top_p) & (probs >= p.min_p * probs[0])
    keep[0] = True
    out = torch.zeros_like(probs)
    out[order[keep]] = probs[keep]
    return out / out.sum()


@pytest.mark.parametrize("kwargs", [dict(top_p=0.8), dict(top_k=3), dict(min_p=0.2), dict(temperature=0.7),
                                    dict(top_k=50, top_p=0.95, temperature=1.3)])
def test_unseeded_draws_follow_the_kept_probabilities(kwargs):
    """20,000 unseeded draws over 4096 tokens (six head tokens, a tail of 4090 holding about 4 %): the
    frequency of each head token and of the tail as a whole lies within 4.5 standard deviations of its
    probability after truncation; dropped tokens are never drawn."""
    vocab, batch, rounds = 4096, 2000, 10
    gen = torch.Generator().manual_seed(11)
    row = torch.randn(vocab, generator=gen) - 8.0
    head = torch.tensor([1234, 7, 4000, 2048, 99, 3001])
    row[head] = torch.tensor([3.0, 2.6, 2.2, 1.8, 1.2, 0.6])
    params = SamplingParams(**kwargs)
    expected = _truncated_distribution(row, params)
    torch.manual_seed(0)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(rounds):
        seqs = [Sequence(str(i), [1], params, 0.0) for i in range(batch)]
        counts += torch.bincount(torch.tensor(Sampler()(row.repeat(batch, 1), seqs).token_ids), minlength=vocab)
    n = batch * rounds
    tail = torch.ones(vocab, dtype=torch.bool)
    tail[head] = False
    for observed, p in [(counts[t].item(), expected[t].item()) for t in head] + [
            (counts[tail].sum().item(), expected[tail].sum().item())]:
        assert abs(observed / n - p) <= 4.5 * (p * (1 - p) / n) ** 0.5 + 1 / n, (kwargs, observed / n, p)
    assert counts[expected == 0].sum() == 0
    assert (expected > 0).sum() > 1  # the test would not see a broken draw if only one token were kept


def test_large_nuclei_are_redone_with_more_candidates_or_the_full_sort(passes):
    """Rows whose kept set goes past the first 64 candidates; seeded ones give the reference's tokens, unseeded
    ones draw inside the kept set:
    - 300 tokens far above 7892 others, top_p 0.9 (about 270 kept): redone with 1024 candidates;
    - nearly flat logits, top_p 0.99: the 64 candidates' mass already shows that thousands are kept, so
      straight to the full sort;
    - nearly flat logits, min_p 0.5 (no such bound for min-p): 1024 candidates, then the full sort."""
    vocab = 8192
    gen = torch.Generator().manual_seed(3)
    moderate = torch.randn(16, vocab, generator=gen) * 0.05 - 5.0
    for row in moderate:
        row[torch.randperm(vocab, generator=gen)[:300]] += 10.0
    flat = torch.randn(16, vocab, generator=gen) * 0.05
    for logits, kwargs, levels in [(moderate, dict(top_p=0.9), {64, 1024}), (flat, dict(top_p=0.99), {64, vocab}),
                                   (flat, dict(min_p=0.5), {64, 1024, vocab})]:
        passes.clear()
        params = [SamplingParams(seed=i, **kwargs) for i in range(8)] + [SamplingParams(**kwargs)] * 8
        ours, theirs = _twins(params, [[1]] * 16)
        assert _assert_same_as_reference([logits], ours, theirs) == 8
        visited = {k for _, k in passes}
        assert passes[0] == (16, 64) and levels <= visited <= levels | {vocab}, (kwargs, passes)
        for row in range(8, 16):
            kept = _truncated_distribution(logits[row], params[row]) > 0
            assert kept.sum() > 64 and kept[ours[row].output_token_ids[0]]


def test_rows_without_truncation(passes):
    """Temperature only: seeded rows rank the whole vocabulary (the reference's sort and noise, so its tokens);
    unseeded rows are drawn in token order without any ranked pass."""
    vocab = 8192
    gen = torch.Generator().manual_seed(4)
    steps = [torch.randn(8, vocab, generator=gen) * 3 for _ in range(2)]
    seeded = [SamplingParams(seed=i, temperature=0.9) for i in range(8)]
    assert _assert_same_as_reference(steps, *_twins(seeded, [[1]] * 8)) == 16
    assert passes == [(8, vocab)] * 2
    passes.clear()
    unseeded = [Sequence(str(i), [1], SamplingParams(temperature=0.9), 0.0) for i in range(8)]
    tokens = Sampler()(steps[0], unseeded).token_ids
    assert passes == [] and all(0 <= t < vocab for t in tokens)


def test_greedy_and_top_k_1_rows_take_the_argmax_of_the_penalized_logits():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 3000, generator=gen)
    logits[:, 17] = 5.0  # the raw argmax; a repetition penalty of 3 brings it below the runner-up
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=1.5, seed=2),
              SamplingParams(temperature=0.0, repetition_penalty=3.0), SamplingParams(top_k=1, repetition_penalty=3.0)]
    seqs = [Sequence(str(i), [17], p, 0.0) for i, p in enumerate(params)]
    runner_up = logits[2:].clone()
    runner_up[:, 17] = -1.0
    assert Sampler()(logits, seqs).token_ids == [17, 17] + runner_up.argmax(dim=-1).tolist()
    assert seqs[1].generator is None  # greedy rows draw no noise


@pytest.mark.parametrize("vocab", [49152, 128256, 4096 + 96, 1001])
def test_blocked_argmax_is_the_first_maximum(vocab):
    """Greedy rows use sampling_ops.argmax: equal to torch's argmax (the first maximal index) with ties inside and
    across blocks, a row of equal values, and -inf entries; 1001 tokens take torch's argmax itself."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=gen)
    x[0, [900, 17, 3000 % vocab]] = 9.0  # ties across blocks: 17 first
    x[1, [130, 129]] = 9.0  # ties inside a block
    x[2] = 1.5
    x[3, : vocab // 2] = float("-inf")
    expected = x.argmax(dim=-1)
    assert expected[:3].tolist() == [17, 129, 0]
    assert torch.equal(sampling_ops.argmax(x), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_generator_lives_on_the_logits_device_and_tokens_do_not_depend_on_the_batch(device):
    """A seeded request alone, or in a batch whose other rows change the candidate count (top_k 300), the full
    sort (top_k 1000 of 2048) and the noise drawn (unseeded, greedy rows), draws the same tokens."""
    gen = torch.Generator().manual_seed(8)
    steps = [(torch.randn(5, 2048, generator=gen) * 2).to(device) for _ in range(4)]
    params = SamplingParams(seed=123, top_p=0.9, temperature=0.9)
    alone = Sequence("a", [1], params, 0.0)
    other_seed = Sequence("x", [1], SamplingParams(seed=124, top_p=0.9, temperature=0.9), 0.0)
    crowd = [Sequence("b", [1], params, 0.0), Sequence("c", [1], SamplingParams(top_k=300, seed=5), 0.0),
             Sequence("d", [1], SamplingParams(top_k=1000, seed=6), 0.0), Sequence("e", [1], SamplingParams(), 0.0),
             Sequence("f", [1], SamplingParams(temperature=0.0), 0.0)]
    assert alone.generator is None
    for logits in steps:
        token = Sampler()(logits[:1], [alone]).token_ids[0]
        crowd_tokens = Sampler()(logits, crowd).token_ids
        assert crowd_tokens[0] == token
        alone.token_ids.append(token)
        for seq, t in zip(crowd, crowd_tokens):
            seq.token_ids.append(t)
        other_seed.token_ids.append(Sampler()(logits[:1], [other_seed]).token_ids[0])
    assert alone.generator.device.type == device
    assert other_seed.output_token_ids != alone.output_token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rows_agree_with_the_cpu_where_the_noise_does_not_matter():
    """On CUDA: greedy tokens and logprobs as on the CPU; sampled tokens inside the kept sets."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(24, 49152, generator=gen) * 3
    params = ([SamplingParams(temperature=0.0, logprobs=5)] * 8
              + [SamplingParams(top_p=0.9, logprobs=2), SamplingParams(top_k=20), SamplingParams(min_p=0.1),
                 SamplingParams(temperature=0.7), SamplingParams(top_p=0.99, seed=1),
                 SamplingParams(top_k=40, top_p=0.8, seed=2), SamplingParams(seed=3),
                 SamplingParams(top_p=0.9, seed=4)] * 2)
    cpu = Sampler()(logits, [Sequence(str(i), [1], p, 0.0) for i, p in enumerate(params)])
    cuda = Sampler()(logits.cuda(), [Sequence(str(i), [1], p, 0.0) for i, p in enumerate(params)])
    assert cuda.token_ids[:8] == cpu.token_ids[:8]
    for row, p in enumerate(params):
        if p.logprobs is not None:
            assert [t for t, _ in cuda.logprobs[row][1]] == [t for t, _ in cpu.logprobs[row][1]]
            assert cuda.logprobs[row][0] == pytest.approx(
                torch.log_softmax(logits[row].double(), -1)[cuda.token_ids[row]].item(), abs=1e-4)
        if not p.greedy:
            assert _truncated_distribution(logits[row], p)[cuda.token_ids[row]] > 0


def test_seeded_sampling_survives_preemption(tiny_qwen2_path):
    """6 seeded requests sampling with top-p share a cache of 8 blocks and get preempted; their generators stay
    on the sequences, so they produce the tokens they produce with room to spare."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (20,), generator=g).tolist() for _ in range(6)]
    params = [SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=40 + i, ignore_eos=True)
              for i in range(6)]

    def run(blocks: int) -> tuple[list[list[int]], int]:
        engine = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", block_size=16,
                                        num_kv_blocks=blocks, max_num_seqs=8, max_num_batched_tokens=128,
                                        max_model_len=512))
        return [o.token_ids for o in engine.generate(prompts, params)], engine.scheduler.num_preemptions

    roomy, _ = run(64)
    tight, preemptions = run(8)
    assert preemptions > 0
    assert tight == roomy
    assert len({tuple(t) for t in roomy}) == 6


@pytest.mark.parametrize("vocab,first,longer", [(5, 2, 5), (100, 7, 64), (8192, 64, 1024), (128256, 1024, 16384)])
def test_seeded_noise_on_the_cpu_is_the_old_stream(vocab, first, longer):
    """The CPU shortcut of the seeded noise: drawing `first` exponentials and moving the generator past the
    rest gives the first values of a V-long exponential_ and leaves the generator where V draws leave it; a
    longer prefix drawn again from the saved state continues the same values."""
    old = torch.Generator().manual_seed(99)
    expected = torch.empty(vocab).exponential_(generator=old)
    generator = torch.Generator().manual_seed(99)
    noise = sampler_module._SeededNoise([generator], [first], vocab, torch.device("cpu"))
    assert torch.equal(generator.get_state(), old.get_state())
    assert torch.equal(noise.ranks([0], first)[0], expected[:first])
    assert torch.equal(noise.ranks([0], longer)[0], expected[:longer])
    assert torch.equal(torch.empty(8).exponential_(generator=generator),
                       torch.empty(8).exponential_(generator=old))
