"""Continuous batching with chunked prefill, admission by whole prompts and preemption by recompute.

Each step, in this order:

1. **Decodes first.** Every running sequence in decode (oldest admitted first, up to the sequence limit) gets
   one token of the per-step token budget and, when its next token starts a block, one more KV block. When no
   block is free, the most recently admitted running sequence is preempted: its blocks are freed and it goes
   back to the front of the waiting queue to be prefilled again later (recompute preemption, as in vLLM: Kwon
   et al., SOSP 2023). Decodes before prefill chunks is Sarathi-Serve's stall-free batching (Agrawal et al.,
   OSDI 2024): a long prompt never stalls the sequences already generating.
2. **Admission.** Waiting sequences are considered in queue order (preempted sequences first, then by
   arrival). One is admitted when a sequence slot is free and the KV blocks for its whole prompt -- for a
   preempted sequence, its prompt and the tokens it generated, all recomputed -- plus the slot of its first
   decode token fit while `watermark_blocks` blocks stay free (1 % of the cache, at least 1; vLLM keeps the
   same 1 % free when it admits a prompt, so that running sequences can grow without being preempted at once).
   Those blocks are allocated at admission, so a running prefill never needs a block later and a newcomer can
   never take the blocks of a prompt already admitted. The watermark does not apply when nothing runs (a
   request may need the whole cache). A preempted sequence must also fit beside the blocks owed to the
   survivors: the blocks a preemption frees are owed to the sequences that kept running until they have grown
   into them or can no longer need them (a sequence needs at most prompt + max_tokens tokens), so a victim is
   never admitted back into the room it left for the others. A sequence is admitted only when the prefill
   budget (4.) would give it a token with the sequences admitted before it; shorter prompts admitted after it in
   the same step may still take that token, and it gets its share in a later step. With prefix caching, the
   leading full blocks of its tokens already in the cache (`BlockManager.cached_prefix`) become its first blocks
   and its prefill starts after them: they count against the free blocks only when they are evictable (free
   until taken), and its remaining prompt is what the prefill budget sees. A waiting sequence whose next block
   after its cached prefix is being computed right now by a running sequence's prefill (in flight: the same
   chained name, `BlockManager.in_flight`) is not admitted: it waits until that prefill has computed and cached
   the blocks they share and then starts with them, so a burst of requests sharing an uncached prefix (a cold
   system prompt) computes it once, not once per request. The idea is SGLang's cache-aware scheduling over its
   radix tree (Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs", NeurIPS 2024).
   Such a sequence holds no slot or block and never stops the queue (3.): the ones behind it are admitted within
   the same budget. It waits only while a running sequence makes progress on its prefix: when that sequence is
   preempted or ends before computing the shared blocks, they leave flight and it computes them itself.
3. **Overtaking, with aging.** A waiting sequence that does not fit does not stop the queue: the ones behind
   it that fit are admitted, but only while it would not fit even if every running sequence that arrived after
   it gave its blocks back. Once it would, nothing behind it is admitted until it is, so later arrivals never
   hold the blocks it waits for longer than the ones already running need to finish.
4. **Prefill budget.** What the decodes leave of the budget, R tokens, is shared by the K prefilling sequences
   (`split_prefill_budget`): the one that arrived first is given min(its remaining prompt, R // K) tokens, so it
   always progresses; the rest goes to the shortest remaining prompts first (shortest remaining processing time
   first, which minimises the mean time to first token: Schrage, Operations Research 16(3), 1968); prompts of
   equal length go in admission order, so a burst of equal prompts is prefilled first come, first served.

Bounds (tokens and steps):

- A prefilling sequence whose remaining prompt p is at most R // K tokens computes all of it in the step: the
  oldest is given at most R // K first and every sequence served before it in shortest-first order has at most
  p tokens left, so at most R // K + (K - 2) * p <= R - p tokens go before it. So a short request is admitted in
  the first step after its arrival when its blocks fit with the watermark, a slot is free, no waiting sequence
  ahead of it has stopped overtaking (3.) and no running prefill is computing its next block (2.), and its first
  token is sampled in that same step when its prompt is at most R // K tokens. At full budget
  R >= max_num_batched_tokens - max_num_seqs + 1 and K <= max_num_seqs: with the defaults (1024, 32) every prompt
  of up to 31 tokens; beside six long prompts prefilling (K = 7) in a 1024-token budget, every prompt of up to 146
  tokens.
- No prompt starves in prefill: while R >= K, the earliest arrival among the prefilling sequences computes at
  least min(remaining, R // K) >= 1 tokens each step, so each prefill ends; a waiting sequence that fits in
  blocks but gets no budget is passed only by shorter prompts. A sequence waiting for blocks in flight waits for
  a running prefill, which ends (as above) or is preempted or aborted: either way the blocks leave flight.
- No thrash: a preemption happens only when the blocks of the running sequences' own tokens fill the cache; the
  victim is always the latest admitted, so a sequence is never preempted for one admitted after it; and a
  preempted sequence, re-admitted only beside what is owed to the survivors and the watermark, is preempted
  again only if the sequences admitted before it outgrow both.

Measured without a model (tests/engine/test_scheduler_policy.py), the long-prompt burst of issue 15 (32 prompts of
1,900 tokens + 100, 728 blocks, 1024-token budget): 6 preemptions, none twice, where 7 sequences could not fit
(the FIFO scheduler before this one: 325, one sequence 59 times); 20-token requests sent during it get their first
token 1 step after arriving (median), 18 at most (before: 365 to 509 steps).

A sequence with input addends (`sequence.InputAddends`: a talker's rows from its thinker) whose next row has not
come yet is neither decoded nor admitted; it keeps its blocks and the others run (it only waits for its producer).

Admission does not reserve blocks for tokens not generated yet (a request's max_tokens is an upper bound, often
the rest of the context for chat): a burst of long generations can still admit one sequence more than fits at
full length, which is then preempted once. TensorRT-LLM's GUARANTEED_NO_EVICT policy reserves prompt + max
output instead and never pauses a request, at the cost of running far fewer sequences when requests stop early.

A step that runs out of device memory (the KV cache is preallocated, so what overflows is the step's
activations) is retried with half the token budget: `shrink_token_budget` halves it, and every
BUDGET_RESTORE_STEPS successful steps (`step_succeeded`) double it back towards max_num_batched_tokens. A smaller
budget makes smaller prefill chunks and, below the number of running sequences, fewer decodes per step (the
others keep their blocks and wait, oldest first).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from omni_backend.engine.block_manager import BlockManager
from omni_backend.engine.sequence import Sequence, SequenceStatus

BUDGET_RESTORE_STEPS = 32


def watermark_blocks(num_blocks: int) -> int:
    """Blocks admission leaves free for running sequences to grow into: 1 % of the cache, at least 1."""
    return max(1, num_blocks // 100)


def split_prefill_budget(budget: int, remaining: list[int], oldest: int) -> list[int]:
    """Tokens each prefilling sequence computes this step.

    The sequence at index `oldest` first gets min(its remaining tokens, budget // K) for K sequences; what is left
    goes to the sequences with the fewest remaining tokens first (counted before this step's share, ties in list
    order), the oldest included for what it still lacks (see the module docstring for the bounds).

    Args:
        budget: tokens of this step left for prefill chunks.
        remaining: uncomputed tokens of each prefilling sequence (each >= 1), in admission order.
        oldest: index in `remaining` of the sequence that arrived first.

    Returns:
        tokens per sequence, in the order of `remaining`; they sum to min(budget, sum(remaining)).
    """
    counts = [0] * len(remaining)
    if not remaining:
        return counts
    counts[oldest] = min(remaining[oldest], budget // len(remaining))
    left = budget - counts[oldest]
    for index in sorted(range(len(remaining)), key=lambda i: remaining[i]):
        take = min(remaining[index] - counts[index], left)
        counts[index] += take
        left -= take
    return counts


@dataclass
class ScheduledBatch:
    """What one engine step computes.

    Attributes:
        seqs: sequences in this step, prefill chunks first, then decodes.
        num_tokens: tokens each sequence computes this step (same order as `seqs`).
        num_prefills: how many leading entries of `seqs` are prefill chunks (q_len may be 1 for a 1-token
            chunk; what matters is that decodes come last and have exactly one token).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_prefills: int = 0

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    """Decides each step's batch (policy and bounds in the module docstring); owns the waiting queue and the
    running list.

    Args:
        block_manager: KV block allocator.
        max_num_seqs: most sequences in one step (capacity; `set_num_seqs_limit` lowers it at run time).
        max_num_batched_tokens: per-step token budget.

    Attributes:
        waiting: sequences not running, preempted ones first, then in arrival order.
        running: admitted sequences holding KV blocks, in admission order (the last one is preempted first).
        watermark_blocks: free blocks admission leaves for running sequences to grow into.
        owed_blocks: free blocks a preempted sequence may not be admitted into: freed by preemptions, not yet grown
            into by the running sequences, at most what they can still need and at most the free blocks (a block freed
            twice, by two preemptions, is owed once).
        num_preemptions: preemptions so far.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.num_seqs_limit = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.token_budget = max_num_batched_tokens  # this step's budget: lowered for a while after an OOM
        self._steps_to_restore = 0
        self.watermark_blocks = watermark_blocks(block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # blocks freed by preemptions that the running sequences have not grown into yet (module docstring, 2.)
        self.owed_blocks = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (the llm stage bounds how many requests it holds: LLMService.capacity)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def set_num_seqs_limit(self, limit: int) -> None:
        """Cap the sequences per step at `limit` (clamped to 1..max_num_seqs; the power governor's hook).

        Running sequences beyond the cap keep their blocks and wait (oldest first are scheduled); no new
        sequence is admitted while the running list is at the cap.
        """
        self.num_seqs_limit = max(1, min(limit, self.max_num_seqs))

    def shrink_token_budget(self) -> bool:
        """Halve the per-step token budget (after a step ran out of device memory); False when it is already 1
        token and cannot shrink."""
        if self.token_budget == 1:
            return False
        self.token_budget //= 2
        self._steps_to_restore = BUDGET_RESTORE_STEPS
        return True

    def step_succeeded(self) -> None:
        """Count a successful step; every BUDGET_RESTORE_STEPS of them double a lowered budget back."""
        if self.token_budget < self.max_num_batched_tokens:
            self._steps_to_restore -= 1
            if self._steps_to_restore <= 0:
                self.token_budget = min(self.max_num_batched_tokens, self.token_budget * 2)
                self._steps_to_restore = BUDGET_RESTORE_STEPS

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and token counts, allocating their KV blocks (may preempt, see the module
        docstring)."""
        self.owed_blocks = min(self.owed_blocks, self.block_manager.num_free_blocks, sum(
            self.block_manager.blocks_needed(s, s.num_prompt_tokens + s.params.max_tokens) for s in self.running))
        budget = self.token_budget
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        index = 0
        while index < min(len(self.running), self.num_seqs_limit):
            seq = self.running[index]
            index += 1
            if not _is_decoding(seq):
                prefills.append(seq)  # its blocks were allocated at admission
            elif not seq.inputs_ready():
                continue  # its next input row has not come: it keeps its blocks and waits, the others go on
            elif len(decodes) < budget and self._grow(seq):
                decodes.append(seq)
        budget -= len(decodes)

        self._admit(prefills, budget)
        counts = split_prefill_budget(budget, [s.num_uncomputed_tokens for s in prefills], _earliest(prefills))
        self.block_manager.pool.flush()
        batch = ScheduledBatch()
        for seq, count in zip(prefills, counts):
            if count:
                batch.seqs.append(seq)
                batch.num_tokens.append(count)
        batch.num_prefills = len(batch.seqs)
        batch.seqs.extend(decodes)
        batch.num_tokens.extend([1] * len(decodes))
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        return batch

    def _admit(self, prefills: list[Sequence], budget: int) -> None:
        """Admit waiting sequences (module docstring, 2. and 3.), appending them to `running` and `prefills`."""
        head = None  # the first waiting sequence that does not fit
        for seq in list(self.waiting):
            if len(self.running) >= self.num_seqs_limit:
                return
            if not seq.inputs_ready():  # a preempted sequence whose last token's input row has not come
                continue
            cached = self.block_manager.cached_prefix(seq)
            if self.block_manager.in_flight(seq, cached):
                continue  # it takes those blocks from the cache once computed; the ones behind it go on (2.)
            if not self._fits(seq, cached):
                if head is None:
                    head = seq
                    if self._later_arrivals_hold_its_blocks(head, cached):
                        return
                continue
            candidates = prefills + [seq]
            remaining = [s.num_uncomputed_tokens for s in prefills] + \
                [len(seq) - len(cached) * self.block_manager.block_size]
            share = split_prefill_budget(budget, remaining, _earliest(candidates))[-1]
            if share == 0:
                continue
            self.waiting.remove(seq)
            self.block_manager.allocate(seq, len(seq) + 1, cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            prefills.append(seq)

    def _blocks_to_admit(self, seq: Sequence, cached: list[int]) -> int:
        """Free blocks a waiting `seq` takes: those for all its tokens (recomputed, except the `cached` prefix it
        starts with) and its next token's slot, plus the cached ones that are evictable now."""
        return self.block_manager.blocks_to_admit(seq, len(seq) + 1, cached)

    def _fits(self, seq: Sequence, cached: list[int]) -> bool:
        """Whether waiting `seq`, starting with the `cached` blocks, can be admitted now as far as blocks go
        (module docstring, 2.)."""
        return self._blocks_to_admit(seq, cached) + self._blocks_kept_free(seq, bool(self.running)) <= \
            self.block_manager.num_free_blocks

    def _blocks_kept_free(self, seq: Sequence, others_run: bool) -> int:
        """Free blocks that admitting waiting `seq` must leave: the watermark while other sequences run, and for
        a preempted sequence also the blocks owed to the survivors."""
        return (self.watermark_blocks if others_run else 0) + (self.owed_blocks if seq.num_preemptions else 0)

    def _later_arrivals_hold_its_blocks(self, head: Sequence, cached: list[int]) -> bool:
        """Whether `head` (starting with the `cached` blocks) would fit if every running sequence that arrived
        after it gave its blocks back (counting each of their blocks, shared ones too: an upper bound)."""
        later = [s for s in self.running if s.arrival > head.arrival]
        if not later:
            return False
        freed = sum(len(s.block_table) for s in later)
        return self._blocks_to_admit(head, cached) + \
            self._blocks_kept_free(head, len(later) < len(self.running)) <= self.block_manager.num_free_blocks + freed

    def _grow(self, seq: Sequence) -> bool:
        """Allocate the block for the next token of decoding `seq`, preempting the latest admitted sequences
        while none is free. Returns False when `seq` itself had to be preempted."""
        while not self.block_manager.can_allocate(seq, len(seq)):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        new_blocks = self.block_manager.blocks_needed(seq, len(seq))
        self.block_manager.allocate(seq, len(seq))
        self.owed_blocks = max(0, self.owed_blocks - new_blocks)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.owed_blocks += len(seq.block_table)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove `seq` (running or waiting), free its blocks at once and mark it finished."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


def _is_decoding(seq: Sequence) -> bool:
    """Whether `seq` has computed its whole prompt and has just its last sampled token to compute."""
    return seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens


def _earliest(seqs: list[Sequence]) -> int:
    """Index of the sequence that arrived first (the first of equals)."""
    return min(range(len(seqs)), key=lambda i: seqs[i].arrival) if seqs else 0
