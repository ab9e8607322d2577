"""Automatic prefix caching (engine/prefix_cache.py, engine/block_manager.py): which blocks are reused, when cached
blocks are evicted, that block accounting returns to baseline, and that greedy outputs do not change with it."""

from __future__ import annotations

import pytest
import torch

from omni_backend.engine.block_manager import BlockManager, BlockTablePool
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.device import Device
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.scheduler import Scheduler
from omni_backend.engine.sequence import PromptEmbeds, Sequence, SequenceStatus

BLOCK_SIZE = 16
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def _manager(num_blocks: int = 32, enable: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BLOCK_SIZE, BlockTablePool(8, 16, Device("cpu")), enable)


def _computed(manager: BlockManager, name: str, token_ids: list[int], embeds: PromptEmbeds | None = None,
              params: SamplingParams = PARAMS) -> Sequence:
    """A sequence admitted with whatever the cache offers, then computed whole and offered to the cache."""
    seq = Sequence(name, token_ids, params, 0.0, embeds)
    manager.allocate(seq, len(seq) + 1, manager.cached_prefix(seq))
    seq.num_computed_tokens = len(seq)
    manager.register_computed_blocks(seq)
    return seq


def _ref_counts_are_zero(manager: BlockManager) -> bool:
    return manager.num_free_blocks == manager.num_blocks and not any(manager._ref_counts)


# --- which blocks are reused ------------------------------------------------------------------------------------------

def test_full_blocks_of_a_computed_prefix_are_reused_and_the_last_token_is_always_computed():
    manager = _manager()
    prompt = list(range(100, 140))  # 40 tokens: blocks 0 and 1 full, block 2 holds 8
    first = _computed(manager, "a", prompt)
    assert manager.num_cached_blocks == 2
    assert manager.cached_prefix(Sequence("b", prompt, PARAMS, 0.0)) == first.block_table[:2]
    # a prompt of exactly two full blocks reuses one: its last token must be computed for its logits
    assert manager.cached_prefix(Sequence("c", prompt[:32], PARAMS, 0.0)) == first.block_table[:1]
    # a different token in block 1 stops the match there
    changed = prompt[:20] + [7] + prompt[21:]
    assert manager.cached_prefix(Sequence("d", changed, PARAMS, 0.0)) == first.block_table[:1]


def test_a_block_is_named_by_everything_before_it():
    """Block 1 of two prompts holds the same ids, but block 0 differs: block 1 is not reused."""
    manager = _manager()
    _computed(manager, "a", list(range(100, 140)))
    other_start = [1] * 16 + list(range(116, 140))
    assert manager.cached_prefix(Sequence("b", other_start, PARAMS, 0.0)) == []


def test_same_placeholder_ids_with_different_embeddings_share_nothing():
    """An image enters as placeholder ids whose embeddings differ per image: the embeddings are part of the block's
    name, so another image never reuses its blocks; the same image does."""
    manager = _manager()
    prompt = [1, 2] + [9] * 20 + list(range(200, 220))  # placeholders at positions 2..21 (blocks 0 and 1)
    positions = torch.arange(2, 22)
    image = torch.randn(20, 8, generator=torch.Generator().manual_seed(0))
    _computed(manager, "a", prompt, PromptEmbeds(positions, image))
    other_image = image.clone()
    other_image[19, 0] += 1e-3  # one value of one row (position 21, block 1)
    reuse_same = manager.cached_prefix(Sequence("b", prompt, PARAMS, 0.0, PromptEmbeds(positions, image.clone())))
    reuse_other = manager.cached_prefix(Sequence("c", prompt, PARAMS, 0.0, PromptEmbeds(positions, other_image)))
    reuse_none = manager.cached_prefix(Sequence("d", prompt, PARAMS, 0.0))
    assert len(reuse_same) == 2
    assert len(reuse_other) == 1  # block 0's rows are equal, block 1's differ in one value
    assert reuse_none == []  # the bare placeholder ids name other blocks


def test_requests_for_prompt_logprobs_and_a_disabled_cache_reuse_nothing():
    manager = _manager()
    prompt = list(range(100, 140))
    _computed(manager, "a", prompt)
    assert manager.cached_prefix(Sequence("b", prompt, SamplingParams(prompt_logprobs=1), 0.0)) == []
    disabled = _manager(enable=False)
    _computed(disabled, "a", prompt)
    assert disabled.num_cached_blocks == 0
    assert disabled.cached_prefix(Sequence("b", prompt, PARAMS, 0.0)) == []


def test_admission_counts_queries_and_hits_in_tokens_and_the_request_keeps_its_cached_tokens():
    manager = _manager()
    prompt = list(range(100, 140))
    _computed(manager, "a", prompt)
    again = Sequence("b", prompt, PARAMS, 0.0)
    manager.allocate(again, len(again) + 1, manager.cached_prefix(again))
    assert again.num_computed_tokens == 32  # only the last 8 tokens are left to prefill
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (80, 32)
    assert again.num_cached_tokens == 32
    assert again.block_table[:2] == manager.cached_prefix(Sequence("c", prompt, PARAMS, 0.0))


# --- eviction and accounting ------------------------------------------------------------------------------------------

def test_freed_blocks_stay_cached_until_a_new_block_is_needed_and_go_least_recently_freed_first():
    manager = _manager(num_blocks=8)
    a = _computed(manager, "a", list(range(100, 133)))  # 33 tokens + 1: 3 blocks, 2 named
    b = _computed(manager, "b", list(range(300, 333)))
    a_blocks, b_blocks = a.block_table[:2], b.block_table[:2]
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 8 and manager.num_cached_blocks == 4
    # 4 unnamed free blocks go first, then a's blocks (freed first: last block first), then b's
    filler = Sequence("f", [1] * 80, PARAMS, 0.0)  # 81 tokens: 6 blocks
    manager.allocate(filler, 81)
    assert manager.num_cached_blocks == 2
    assert manager.cached_prefix(Sequence("a2", list(range(100, 133)), PARAMS, 0.0)) == []
    assert manager.cached_prefix(Sequence("b2", list(range(300, 333)), PARAMS, 0.0)) == b_blocks
    assert set(filler.block_table) & set(a_blocks) == set(a_blocks)


def test_a_shared_block_lives_while_any_sequence_references_it():
    manager = _manager(num_blocks=6)
    prompt = list(range(100, 133))
    a = _computed(manager, "a", prompt)
    b = _computed(manager, "b", prompt)  # shares a's 2 named blocks, owns 1
    assert manager.num_free_blocks == 6 - 4
    manager.free(a)
    assert manager.num_free_blocks == 6 - 3  # a's own last block only
    filler = Sequence("f", [1] * 40, PARAMS, 0.0)
    manager.allocate(filler, 41)  # 3 blocks: everything free, and no shared block among them
    assert not set(filler.block_table) & set(b.block_table)
    manager.free(b)
    manager.free(filler)
    assert _ref_counts_are_zero(manager)


def test_a_block_computed_twice_keeps_one_name_and_the_copy_is_freed_unnamed():
    manager = _manager(num_blocks=8)
    prompt = list(range(100, 133))
    a = Sequence("a", prompt, PARAMS, 0.0)
    b = Sequence("b", prompt, PARAMS, 0.0)
    for seq in (a, b):  # both admitted before either is computed
        manager.allocate(seq, len(seq) + 1, manager.cached_prefix(seq))
    for seq in (a, b):
        seq.num_computed_tokens = len(seq)
        manager.register_computed_blocks(seq)
    assert manager.num_cached_blocks == 2
    manager.free(b)
    manager.free(a)
    assert manager.num_cached_blocks == 2 and _ref_counts_are_zero(manager)


def test_reset_forgets_every_name_and_keeps_blocks_in_use():
    manager = _manager()
    prompt = list(range(100, 140))
    held = _computed(manager, "a", prompt)
    still_running = _computed(manager, "b", list(range(300, 340)))
    manager.free(held)
    assert manager.reset_prefix_cache() == 4
    assert manager.num_cached_blocks == 0
    assert manager.cached_prefix(Sequence("c", prompt, PARAMS, 0.0)) == []
    assert manager.num_free_blocks == 32 - len(still_running.block_table)


def _step(scheduler: Scheduler) -> dict[str, int]:
    """One step as the engine runs it, without a model: schedule, compute, offer computed blocks to the cache,
    append token 5 to every sequence whose last token was computed, finish those at max_tokens. Returns the tokens
    each sequence computed (by request id)."""
    batch = scheduler.schedule()
    for seq, count in zip(batch.seqs, batch.num_tokens):
        seq.num_computed_tokens += count
        scheduler.block_manager.register_computed_blocks(seq)
        if seq.num_computed_tokens == len(seq):
            seq.token_ids.append(5)
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq, "length")
    return {seq.request_id: count for seq, count in zip(batch.seqs, batch.num_tokens)}


def test_block_accounting_returns_to_baseline_after_preemptions_and_aborts():
    """Sequences sharing a prefix run through a cache too small for all of them (preemptions), some aborted while
    prefilling or decoding: at the end every block is free and unreferenced, none is in flight, and the cache still
    holds names."""
    manager = _manager(num_blocks=20)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=48)
    shared = list(range(100, 164))
    seqs = [Sequence(f"r{i}", shared + [1000 + i] * (10 + 7 * i), SamplingParams(max_tokens=60, ignore_eos=True),
                     float(i)) for i in range(6)]
    for seq in seqs:
        scheduler.add(seq)
    steps = 0
    while scheduler.has_work():
        _step(scheduler)
        steps += 1
        if steps == 3:
            scheduler.finish(seqs[4], "abort")  # mid-prefill or waiting
        if steps == 12:
            scheduler.finish(seqs[1], "abort")  # decoding
        assert steps < 2000
    assert scheduler.num_preemptions > 0
    assert manager.prefix_cache_hits > 0
    assert _ref_counts_are_zero(manager) and not manager._in_flight
    assert manager.num_cached_blocks > 0


# --- a prefix being computed: later requests wait for it instead of computing it again --------------------------------

SHARED = list(range(100, 164))  # 4 full blocks


def _asker(name: str, tail: int, arrival: float, max_tokens: int = 2) -> Sequence:
    """A request with the 64 SHARED tokens and a tail of 9 tokens of its own."""
    return Sequence(name, SHARED + [tail] * 9, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival)


def test_a_cold_wave_sharing_a_prefix_computes_it_once_and_an_unrelated_request_is_not_delayed():
    """Four requests share 4 uncached blocks and arrive with an unrelated one, in a 100-token budget. The first
    computes the shared blocks; the unrelated one is admitted beside it in step 1; the other three, which the budget
    would have admitted too, wait, take the 4 blocks from the cache once computed, and prefill only their own 9
    tokens."""
    manager = _manager(num_blocks=64)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=100)
    askers = [_asker(f"a{i}", 1000 + i, float(i)) for i in range(4)]
    unrelated = Sequence("u", list(range(500, 530)), SamplingParams(max_tokens=2, ignore_eos=True), 2.5)
    for seq in askers[:3] + [unrelated, askers[3]]:
        scheduler.add(seq)
    computed: dict[str, int] = {}
    admitted: dict[str, int] = {}
    step = 0
    while scheduler.has_work():
        step += 1
        for name, count in _step(scheduler).items():
            computed[name] = computed.get(name, 0) + count
            admitted.setdefault(name, step)
        assert step < 20
    assert admitted["a0"] == admitted["u"] == 1
    # step 1 computes u's 30 tokens and 70 of a0's 73 (chunked): the shared blocks are cached after it
    assert admitted["a1"] == admitted["a2"] == admitted["a3"] == 2
    assert [seq.num_cached_tokens for seq in askers] == [0, 64, 64, 64]
    # prompt + 1 generated token fed back each; the shared 64 tokens once
    assert computed == {"a0": 74, "a1": 10, "a2": 10, "a3": 10, "u": 31}
    assert (manager.prefix_cache_queries - manager.prefix_cache_hits) == 73 + 3 * 9 + 30
    assert _ref_counts_are_zero(manager) and not manager._in_flight


def test_a_waiting_request_computes_the_prefix_itself_when_the_one_computing_it_is_preempted_or_aborted():
    """A 164-token prompt computes the shared blocks 16 tokens a step; a 66-token one sharing them (which the
    budget would admit beside it) waits, through the other's preemption, until it is aborted, then computes the
    rest of the prefix itself."""
    manager = _manager(num_blocks=64)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    filler, waiter = Sequence("f", SHARED + [1000] * 100, params, 0.0), Sequence("w", SHARED + [1001] * 2, params, 1.0)
    scheduler.add(filler)
    scheduler.add(waiter)
    assert _step(scheduler) == {"f": 16}  # block 0 computed, the rest in flight
    assert waiter.status is SequenceStatus.WAITING and manager.in_flight(waiter, manager.cached_prefix(waiter))
    scheduler._preempt(filler)  # its blocks in flight land uncomputed
    assert not manager._in_flight
    assert _step(scheduler) == {"f": 16}  # re-admitted first from its cached block 0, it computes block 1
    assert waiter.status is SequenceStatus.WAITING
    scheduler.finish(filler, "abort")
    assert not manager._in_flight
    assert _step(scheduler) == {"w": 16}  # from the cached blocks 0 and 1, it computes block 2
    while scheduler.has_work():
        _step(scheduler)
    assert waiter.finish_reason == "length" and waiter.num_cached_tokens == 32
    assert _ref_counts_are_zero(manager) and not manager._in_flight and manager.num_cached_blocks == 4


def test_blocks_in_flight_are_named_by_their_embeddings_too():
    """A waiting request with the same placeholder ids waits for a running one's blocks only when its image is the
    same."""
    manager = _manager()
    prompt = [1, 2] + [9] * 20 + list(range(200, 220))
    positions = torch.arange(2, 22)
    image = torch.randn(20, 8, generator=torch.Generator().manual_seed(0))
    running = Sequence("a", prompt, PARAMS, 0.0, PromptEmbeds(positions, image))
    manager.allocate(running, len(running) + 1, manager.cached_prefix(running))
    other_image = image.clone()
    other_image[0, 0] += 1e-3  # position 2, block 0
    same = Sequence("b", prompt, PARAMS, 1.0, PromptEmbeds(positions, image.clone()))
    other = Sequence("c", prompt, PARAMS, 1.0, PromptEmbeds(positions, other_image))
    assert manager.in_flight(same, manager.cached_prefix(same))
    assert not manager.in_flight(other, manager.cached_prefix(other))
    assert not manager.in_flight(Sequence("d", prompt, SamplingParams(prompt_logprobs=1), 1.0, PromptEmbeds(
        positions, image.clone())), [])  # it reads the prefill's hidden states: it cannot take blocks from the cache


# --- the engine: greedy outputs with the cache on and off -------------------------------------------------------------

SYSTEM = "You are a helpful assistant who answers questions about geography, history and cooking in one sentence. "
QUESTIONS = ["What is the capital of France?", "Name a river in Africa.", "How long do I boil an egg?",
             "Who built the pyramids?", "What is the tallest mountain?", "Where is Lima?"]


def _prompts(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """Two waves: shared system prompt + questions, an unrelated prompt; then repeats, new questions and a second
    turn that resends a whole first exchange."""
    system = tokenizer.encode(SYSTEM * 3)
    ask = [system + tokenizer.encode(q) for q in QUESTIONS]
    unrelated = tokenizer.encode("Write a short poem about the sea and the wind and the rain. " * 2)
    first = [ask[0], ask[1], unrelated, ask[2]]
    second_turn = ask[0] + tokenizer.encode(" Paris. And of Spain?")
    return first, [ask[0], ask[3], second_turn, unrelated, ask[4], ask[5]]


def _run(path: str, enable: bool, backend: str, max_tokens: int, **limits) -> tuple[list[list[int]], list[int],
                                                                                    LLMEngine]:
    engine = LLMEngine(EngineConfig(model_path=path, dtype="float32", attention_backend=backend, max_model_len=512,
                                    enable_prefix_caching=enable, **limits))
    first, second = _prompts(engine.tokenizer)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(first, params) + engine.generate(second, params)
    return [o.token_ids for o in outputs], [o.cached_tokens for o in outputs], engine


WHOLE = {"num_kv_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 1024, "max_tokens": 12}
CHUNKED = {"num_kv_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 40, "max_tokens": 12}
PREEMPTING = {"num_kv_blocks": 20, "max_num_seqs": 8, "max_num_batched_tokens": 256, "max_tokens": 40}


# Every schedule on both CPU backends with the tiny random Qwen2 (GQA, QKV bias: a few ms per step), and the
# hardest one on SmolLM2 itself, the model users get.
@pytest.mark.parametrize("model, backend, limits", [
    *[("tiny_qwen2_path", backend, limits) for backend in ("cpu", "torch") for limits in (WHOLE, CHUNKED, PREEMPTING)],
    ("smollm2_path", "cpu", PREEMPTING),
], ids=[*[f"tiny-qwen2-{b}-{n}" for b in ("cpu", "torch") for n in ("whole", "chunked", "preempting")],
        "smollm2-cpu-preempting"])
def test_greedy_outputs_are_the_same_with_the_cache_on_and_off(request, model, backend, limits):
    path = request.getfixturevalue(model)
    on_tokens, on_cached, on = _run(path, True, backend, **limits)
    off_tokens, off_cached, off = _run(path, False, backend, **limits)
    assert on_tokens == off_tokens
    assert off_cached == [0] * 10 and off.runner.block_manager.prefix_cache_hits == 0
    manager = on.runner.block_manager
    # the counters count every admission, a preempted sequence's again; cached_tokens its first admission only
    assert manager.prefix_cache_hits >= sum(on_cached) > 0
    if limits["num_kv_blocks"] == 256:
        assert manager.prefix_cache_hits == sum(on_cached)
        system_blocks = len(on.tokenizer.encode(SYSTEM * 3)) // BLOCK_SIZE * BLOCK_SIZE
        assert on_cached[4] >= system_blocks  # the repeated first question
        assert on_cached[6] >= system_blocks  # the second turn
    else:
        assert on.scheduler.num_preemptions > 0
    assert manager.num_free_blocks == manager.num_blocks and not any(manager._ref_counts)


def test_aborted_requests_leave_reusable_blocks_and_the_next_request_is_right(smollm2_path):
    engine = LLMEngine(EngineConfig(model_path=smollm2_path, dtype="float32", max_model_len=512, num_kv_blocks=64,
                                    max_num_batched_tokens=48))
    prompt = engine.tokenizer.encode(SYSTEM * 3 + QUESTIONS[0])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("prefilling", prompt, params)
    engine.step()
    engine.abort("prefilling")  # 48 of its tokens computed: 3 full blocks cached
    manager = engine.runner.block_manager
    assert manager.num_free_blocks == manager.num_blocks and manager.num_cached_blocks == 3
    again = engine.generate([prompt], params)[0]
    assert again.cached_tokens == 48
    reference = LLMEngine(EngineConfig(model_path=smollm2_path, dtype="float32", max_model_len=512, num_kv_blocks=64,
                                       enable_prefix_caching=False)).generate([prompt], params)[0]
    assert again.token_ids == reference.token_ids


def test_images_behind_the_same_placeholder_ids_reuse_only_their_own_blocks(tiny_qwen2_path):
    """Prompt: 20 text tokens, 24 image placeholders (positions 20-43), 10 text tokens (54 tokens, 3 full blocks
    can hit). Image B after image A reuses block 0 only (its blocks 1 and 2 hold B's embeddings); image A again
    reuses all 3; the tokens equal those of an engine without the cache."""
    prompt = list(range(300, 320)) + [7] * 24 + list(range(400, 410))
    positions = torch.arange(20, 44)
    generator = torch.Generator().manual_seed(0)
    image_a, image_b = torch.randn(24, 64, generator=generator), torch.randn(24, 64, generator=generator)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)

    def run(enable: bool) -> list[tuple[list, int]]:
        engine = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=64,
                                        max_model_len=128, enable_prefix_caching=enable))
        results = []
        for name, image in (("a", image_a), ("b", image_b), ("a-again", image_a)):
            engine.add_request(name, prompt, params, prompt_embeds=PromptEmbeds(positions, image.clone()))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:  # a random tiny model repeats tokens: compare logprobs too
                        results.append(([(lp.token_id, round(lp.logprob, 4)) for lp in out.logprobs],
                                        out.cached_tokens))
        return results

    on, off = run(True), run(False)
    assert [tokens for tokens, _ in on] == [tokens for tokens, _ in off]
    assert on[0][0] != on[1][0]  # the images do change the answer
    assert [cached for _, cached in on] == [0, 16, 48]


@pytest.mark.parametrize("budget", [1024, 24], ids=["whole", "chunked"])
def test_a_cold_wave_through_the_engine_computes_the_shared_prompt_once_and_keeps_its_tokens(tiny_qwen2_path, budget):
    """Six questions behind one uncached 55-token system prompt (3 full blocks), sent at once: the first computes the
    system prompt, the other five take its 3 blocks from the cache (which they could not, sent at once, without
    waiting for them); the greedy tokens are those of an engine without the cache."""
    def run(enable: bool) -> tuple[list, LLMEngine, list[list[int]]]:
        engine = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", max_model_len=512,
                                        num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=budget,
                                        enable_prefix_caching=enable))
        system = engine.tokenizer.encode(SYSTEM * 3)
        prompts = [system + engine.tokenizer.encode(q) for q in QUESTIONS]
        return engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)), engine, \
            prompts

    on, engine, prompts = run(True)
    off, _, _ = run(False)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.cached_tokens for o in on] == [0] + [48] * 5
    manager = engine.runner.block_manager
    computed = manager.prefix_cache_queries - manager.prefix_cache_hits  # prompt tokens prefilled
    assert computed == sum(len(p) for p in prompts) - 5 * 48


def test_a_request_waiting_for_an_aborted_prefill_computes_the_prefix_and_its_tokens_are_right(tiny_qwen2_path):
    config = {"model_path": tiny_qwen2_path, "dtype": "float32", "max_model_len": 512, "num_kv_blocks": 64,
              "max_num_seqs": 8, "max_num_batched_tokens": 24}
    engine = LLMEngine(EngineConfig(**config))
    system = engine.tokenizer.encode(SYSTEM * 3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("filler", system + engine.tokenizer.encode(QUESTIONS[0]), params)
    engine.add_request("waiter", system + engine.tokenizer.encode(QUESTIONS[1]), params)
    engine.step()  # the filler computes 24 tokens (block 0 cached), the waiter waits for blocks 1 and 2
    assert engine.requests["waiter"].seq.status is SequenceStatus.WAITING
    engine.abort("filler")
    outputs = []
    while engine.has_unfinished():
        outputs += [out for out in engine.step() if out.finished]
    assert [(o.request_id, o.cached_tokens) for o in outputs] == [("waiter", 16)]
    reference = LLMEngine(EngineConfig(**config, enable_prefix_caching=False)).generate(
        [system + engine.tokenizer.encode(QUESTIONS[1])], params)[0]
    assert outputs[0].token_ids == reference.token_ids
