"""Continuous batching with chunked prefill and preemption by recompute.

Each step takes, in FIFO order of arrival, (1) one token for every running sequence in decode and the next
prompt chunk of running sequences still in prefill, then (2) waiting sequences while the per-step token
budget, the sequence limit and free KV blocks allow. A waiting sequence that does not fit blocks the ones
behind it (FIFO fairness: no overtaking). When a running sequence needs a block and none is free, the most
recently arrived running sequence is preempted: its blocks are freed and it goes back to the front of the
waiting queue to be prefilled again later (recompute preemption, as in vLLM: Kwon et al., SOSP 2023).

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
    """Decides each step's batch; owns the waiting queue and the running list.

    Args:
        block_manager: KV block allocator.
        max_num_seqs: most sequences in one step (capacity; `set_num_seqs_limit` lowers it at run time).
        max_num_batched_tokens: per-step token budget.
        max_waiting: bound on the waiting queue (None: unbounded); `add` raises OverflowError past it.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_waiting: int | None = None):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.num_seqs_limit = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.token_budget = max_num_batched_tokens  # this step's budget: lowered for a while after an OOM
        self._steps_to_restore = 0
        self.max_waiting = max_waiting
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises OverflowError when the waiting queue is full."""
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise OverflowError(f"waiting queue is full ({self.max_waiting} requests)")
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
        """Pick this step's sequences and token counts, allocating their KV blocks."""
        budget = self.token_budget
        prefills: list[tuple[Sequence, int]] = []
        decodes: list[Sequence] = []

        index = 0
        while index < min(len(self.running), self.num_seqs_limit) and budget > 0:
            seq = self.running[index]
            count = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, count):
                break  # seq itself was preempted
            if seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                decodes.append(seq)
            else:
                prefills.append((seq, count))
            budget -= count
            index += 1

        while self.waiting and budget > 0 and len(self.running) < self.num_seqs_limit:
            seq = self.waiting[0]
            count = min(seq.num_uncomputed_tokens, budget)
            if self.block_manager.pool.num_free_rows == 0 or not self.block_manager.can_allocate(
                    seq, seq.num_computed_tokens + count):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, seq.num_computed_tokens + count)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            prefills.append((seq, count))
            budget -= count

        self.block_manager.pool.flush()
        batch = ScheduledBatch(num_prefills=len(prefills))
        for seq, count in prefills:
            batch.seqs.append(seq)
            batch.num_tokens.append(count)
        for seq in decodes:
            batch.seqs.append(seq)
            batch.num_tokens.append(1)
        return batch

    def _reserve(self, seq: Sequence, count: int) -> bool:
        """Allocate blocks for `count` more tokens of running `seq`, preempting newer sequences if needed.

        Returns False when `seq` itself had to be preempted.
        """
        target = seq.num_computed_tokens + count
        while not self.block_manager.can_allocate(seq, target):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, target)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
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
