"""One request's tokens, KV-cache blocks and generation state."""

from __future__ import annotations

import enum

import torch

from omni_backend.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request inside the engine.

    Token bookkeeping: `token_ids` = prompt + generated tokens; `num_computed_tokens` = how many of them have
    their K/V in the cache. A sequence in decode has exactly one uncomputed token (the last sampled one).
    After preemption by recompute `num_computed_tokens` returns to 0 and the whole prefix is prefilled again.

    Attributes:
        block_table: KV-cache block ids, host copy (the device copy is a row of the block-table pool).
        pool_row: row in the block-table pool while running, else None.
        generator: per-request RNG when a seed is given (same seed + prompt -> same tokens).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: float):
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.params = params
        self.arrival = arrival
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.pool_row: int | None = None
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.first_token_time: float | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
