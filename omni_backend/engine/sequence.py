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


class PromptPositions:
    """The M-RoPE position ids of a prompt (models whose `position_rows` is 3, models/qwen2_5_omni.py): a (t, h, w)
    row of ids per prompt token, equal for text, a patch's grid position for an image or a video, time-aligned for
    audio and video (transformers' `get_rope_index`).

    Args:
        positions: int64 [3, n] for the n prompt tokens.

    Attributes:
        delta: max id + 1 - n. A token at index i >= n (a generated one) has the three equal ids i + delta, as
            transformers continues with its `rope_deltas`.
    """

    def __init__(self, positions: torch.Tensor):
        self.positions = positions.to(torch.int64)
        shaped = self.positions.dim() == 2 and self.positions.numel() > 0  # `check` refuses other shapes
        self.delta = int(self.positions.max()) + 1 - self.positions.shape[1] if shaped else 0

    def check(self, num_prompt_tokens: int, max_tokens: int, limit: int) -> None:
        """Raises ValueError when the ids are not [3, num_prompt_tokens], one is negative, or the ids of the prompt
        and `max_tokens` generated tokens reach `limit` (the model's RoPE table)."""
        if self.positions.dim() != 2 or tuple(self.positions.shape) != (3, num_prompt_tokens):
            raise ValueError(f"prompt_positions must be [3, {num_prompt_tokens}] (t, h, w ids per prompt token), "
                             f"got {list(self.positions.shape)}")
        if self.positions.min() < 0:
            raise ValueError("prompt_positions must not be negative")
        last = num_prompt_tokens + max_tokens - 1 + self.delta
        if max(int(self.positions.max()), last) >= limit:
            raise ValueError(f"position ids reach {max(int(self.positions.max()), last)}, beyond the model's "
                             f"{limit} rotary positions")

    def rows(self, start: int, end: int) -> torch.Tensor:
        """The ids [3, end - start] of token indices [start, end): the prompt's, then generated tokens' i + delta."""
        prompt = self.positions[:, start:end]
        after = torch.arange(min(max(start, self.positions.shape[1]), end), end, dtype=torch.int64) + self.delta
        return torch.cat([prompt, after.expand(3, -1)], dim=1)


class InputAddends:
    """Rows added to the input embeddings of a sequence's generated tokens, arriving while it runs (Qwen2.5-Omni's
    talker adds a row of its thinker's reply to each codec token's embedding: models/qwen2_5_omni.py).

    Row j is added to the j-th generated token when it is fed back (the token at index num_prompt_tokens + j). Rows
    come in order (`extend`); `finish(tail)` says no more will: after the given rows come the `tail` rows, the last
    of them for every token after that. A sequence whose next row has not come yet waits (`ready`) without holding
    back the others. Only the engine loop's thread touches it once the sequence is queued.

    Args:
        width: the row width (the model's input embedding width).
    """

    def __init__(self, width: int):
        self.width = width
        self._rows = torch.empty(0, width)
        self.count = 0  # rows given so far
        self._tail: torch.Tensor | None = None  # set by finish

    def extend(self, rows: torch.Tensor) -> None:
        """Append rows [k, width] (any float dtype; kept as float32).

        Raises:
            ValueError: rows of another width, or rows after `finish`.
        """
        if rows.dim() != 2 or rows.shape[1] != self.width:
            raise ValueError(f"input addends must be [k, {self.width}], got {list(rows.shape)}")
        if self._tail is not None:
            raise ValueError("input addends were finished; no more rows can follow")
        needed = self.count + rows.shape[0]
        if needed > self._rows.shape[0]:  # capacity doubles: appending n rows copies O(n) in all
            grown = torch.empty(max(needed, 2 * self._rows.shape[0], 16), self.width)
            grown[:self.count] = self._rows[:self.count]
            self._rows = grown
        self._rows[self.count:needed] = rows.float()
        self.count = needed

    def finish(self, tail: torch.Tensor) -> None:
        """No more rows: `tail` [m >= 1, width] follow them, its last row repeated for ever.

        Raises:
            ValueError: a tail of another width or without rows.
        """
        if tail.dim() != 2 or tail.shape[1] != self.width or tail.shape[0] < 1:
            raise ValueError(f"the tail of input addends must be [m >= 1, {self.width}], got {list(tail.shape)}")
        self._tail = tail.float()

    def ready(self, index: int) -> bool:
        """Whether row `index` is known (given, or the rows are finished)."""
        return index < self.count or self._tail is not None

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) as [end - start, width] float32; every one must be `ready`."""
        given = self._rows[start:min(end, self.count)]
        if end <= self.count:
            return given
        last = self._tail.shape[0] - 1
        after = torch.arange(max(start, self.count), end) - self.count
        return torch.cat([given, self._tail[after.clamp(max=last)]])


class Sequence:
    """A request inside the engine.

    Token bookkeeping: `token_ids` = prompt + generated tokens; `num_computed_tokens` = how many of them have
    their K/V in the cache. A sequence in decode has exactly one uncomputed token (the last sampled one).
    After preemption by recompute `num_computed_tokens` returns to 0 and the whole prefix is prefilled again.

    Attributes:
        block_table: KV-cache block ids, host copy (the device copy is a row of the block-table pool).
        prompt_positions: the prompt's M-RoPE position ids, or None where every token's position is its index.
        input_addends: rows added to its generated tokens' input embeddings (`InputAddends`), or None.
        block_hashes: names of the sequence's full blocks computed so far (prefix_cache.py), a memo.
        num_registered_blocks: leading blocks of `block_table` already offered to the prefix cache.
        prefix_cache_resets: the block manager's count of prefix cache resets when it last admitted or offered
            this sequence (a reset since then: its blocks are offered again, block_manager.py).
        num_cached_tokens: prompt tokens whose KV came from the prefix cache when the sequence was first admitted
            (OpenAI's usage.prompt_tokens_details.cached_tokens); None until then.
        pool_row: row in the block-table pool while running, else None.
        hidden_rows: (last-layer hidden states [k, H], input embeddings [k, H]) float32 host tensors of positions
            computed for a request with `params.return_hidden_states`, not yet in an output (engine/hidden_states.py).
        num_hidden_rows: leading positions whose rows were recorded (they are not recorded again after a
            preemption).
        generator: the request's RNG when it has a seed (same seed + prompt -> same tokens): None until the
            sampler first samples for it, then `torch.Generator(device=<logits' device>).manual_seed(seed)`;
            kept through preemption, so the stream goes on where it stopped.
        grammar: the `xgrammar.GrammarMatcher` of a request with a guide (engine/structured_output.py), set when
            its grammar is compiled, advanced with each sampled token; kept through preemption (the generated
            tokens are kept too). None for free text.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: float,
                 prompt_embeds: "PromptEmbeds | None" = None, prompt_positions: PromptPositions | None = None,
                 input_addends: InputAddends | None = None):
        self.prompt_embeds = prompt_embeds
        self.prompt_positions = prompt_positions
        self.input_addends = input_addends
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
        self.prefix_cache_resets = 0
        self.num_cached_tokens: int | None = None
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None  # time.monotonic() when first admitted to a step
        self.first_token_time: float | None = None
        # (token id, logprob, top alternatives) per prompt token, when params.prompt_logprobs asks (prompt_logprobs.py)
        self.prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]]]] = []
        self.generator: torch.Generator | None = None
        self.grammar = None
        self.hidden_rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_hidden_rows = 0

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

    def inputs_ready(self) -> bool:
        """Whether everything its next step feeds is known: the input addend of its last token, if it has addends
        and that token is a generated one."""
        addends = self.input_addends
        return addends is None or self.num_output_tokens == 0 or addends.ready(self.num_output_tokens - 1)

    def position_ids(self, start: int, end: int) -> range | None:
        """The 1-D position ids of token indices [start, end), or None where they are M-RoPE rows that differ
        (a range inside a prompt with `prompt_positions`: `prompt_positions.rows`)."""
        if self.prompt_positions is None:
            return range(start, end)
        if start < self.num_prompt_tokens:
            return None
        delta = self.prompt_positions.delta
        return range(start + delta, end + delta)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
