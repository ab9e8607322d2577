"""One request's tokens, KV-cache blocks and generation state."""

from __future__ import annotations

import enum

import torch

from omni_backend.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class PromptEmbeds:
    """Embeddings that replace the token embeddings at some prompt positions (encoder outputs for image or
    audio placeholder tokens).

    Args:
        positions: int64 [k], distinct prompt positions (0-based).
        embeds: [k, hidden_size] float tensor, one row per position (cast to the model dtype when used).
    """

    def __init__(self, positions: torch.Tensor, embeds: torch.Tensor):
        self.positions = positions.to(torch.int64).reshape(-1)
        self.embeds = embeds

    def check(self, num_prompt_tokens: int, hidden_size: int) -> None:
        """Raises ValueError when the embeddings are not [k, hidden_size] for the k positions, or a position is
        outside the prompt or given twice."""
        if self.embeds.dim() != 2 or tuple(self.embeds.shape) != (self.positions.numel(), hidden_size):
            raise ValueError(f"prompt_embeds must be [{self.positions.numel()}, {hidden_size}] (one row of the "
                             f"model's hidden size per position), got {list(self.embeds.shape)}")
        if self.positions.numel() and (self.positions.min() < 0 or self.positions.max() >= num_prompt_tokens):
            raise ValueError(f"prompt_embed_positions must lie in [0, {num_prompt_tokens})")
        if torch.unique(self.positions).numel() != self.positions.numel():
            raise ValueError("prompt_embed_positions must be distinct")

    def in_range(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions - start, embeds) for positions in [start, end)."""
        keep = (self.positions >= start) & (self.positions < end)
        return self.positions[keep] - start, self.embeds[keep]


class Sequence:
    """A request inside the engine.

    Token bookkeeping: `token_ids` = prompt + generated tokens; `num_computed_tokens` = how many of them have
    their K/V in the cache. A sequence in decode has exactly one uncomputed token (the last sampled one).
    After preemption by recompute `num_computed_tokens` returns to 0 and the whole prefix is prefilled again.

    Attributes:
        block_table: KV-cache block ids, host copy (the device copy is a row of the block-table pool).
        block_hashes: names of the sequence's full blocks computed so far (prefix_cache.py), a memo.
        num_registered_blocks: leading blocks of `block_table` already offered to the prefix cache.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache when the sequence was first admitted
            (OpenAI's usage.prompt_tokens_details.cached_tokens); None until then.
        pool_row: row in the block-table pool while running, else None.
        generator: the request's RNG when it has a seed (same seed + prompt -> same tokens): None until the
            sampler first samples for it, then `torch.Generator(device=<logits' device>).manual_seed(seed)`;
            kept through preemption, so the stream goes on where it stopped.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: float,
                 prompt_embeds: "PromptEmbeds | None" = None):
        self.prompt_embeds = prompt_embeds
        self.request_id = request_id
        self.params = params
        self.arrival = arrival
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.pool_row: int | None = None
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.num_cached_tokens: int | None = None
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None  # time.monotonic() when first admitted to a step
        self.first_token_time: float | None = None
        # (token id, logprob, top alternatives) per prompt token, when params.prompt_logprobs asks (prompt_logprobs.py)
        self.prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]]]] = []
        self.generator: torch.Generator | None = None

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
