"""Sampling settings, seeds, penalties, stop strings, logprobs and UTF-8-safe streaming."""

from __future__ import annotations

import pytest
import torch

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.detokenizer import IncrementalDetokenizer
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampler import Sampler
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import Sequence


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
    logits = torch.tensor([1.0, 2.0, -2.0, 4.0, 1.0])
    Sampler._apply_penalties(logits, seq)
    # ids 1,2,3 seen: positive /2, negative *2; id 3 also gets presence 0.5 + frequency 0.25*2
    assert logits.tolist() == [1.0, 1.0, -4.0, 2.0 - 0.5 - 0.5, 1.0]


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
