"""Repetition, presence and frequency penalties and suppressed tokens on a batch of logits, each row by its own
sequence's settings."""

from __future__ import annotations

import itertools

import torch

from omni_backend.engine.sampling_ops import to_device
from omni_backend.engine.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition, presence and frequency penalties, vectorized over the rows that ask for them.

    Args:
        logits: float32 [B, V] on any device; row i belongs to seqs[i]. Not modified.
        seqs: the B sequences (their params and tokens).
    Returns:
        `logits` itself when no row asks, else a penalized copy [B, V]: with a repetition penalty r != 1 each
        distinct token of the prompt and output becomes x / r if x > 0 else x * r (CTRL); then, with a presence
        or frequency penalty, each distinct generated token becomes x - (frequency * count + presence), count =
        its occurrences in the output (OpenAI). The float32 operations are the pre-#14 sampler's, so the result
        is the same bit for bit. Last, the row's `suppress_token_ids` become -inf (never sampled; transformers'
        SuppressTokensLogitsProcessor, which its generate applies after the repetition penalty).
    """
    vocab = logits.shape[1]
    repeated = [row for row, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    counted = [row for row, s in enumerate(seqs)
               if (s.params.presence_penalty or s.params.frequency_penalty) and s.num_output_tokens]
    suppressed = [row for row, s in enumerate(seqs) if s.params.suppress_token_ids]
    if not repeated and not counted and not suppressed:
        return logits
    logits = logits.clone(memory_format=torch.contiguous_format)
    flat = logits.view(-1)
    if repeated:
        positions, owner, _ = _token_positions([seqs[row].token_ids for row in repeated], repeated, vocab,
                                               logits.device)
        penalty = to_device([seqs[row].params.repetition_penalty for row in repeated], torch.float32,
                             logits.device)[owner]
        values = flat[positions]
        flat[positions] = torch.where(values > 0, values / penalty, values * penalty)
    if counted:
        positions, owner, count = _token_positions([seqs[row].output_token_ids for row in counted], counted,
                                                   vocab, logits.device)
        weights = to_device([[seqs[row].params.frequency_penalty, seqs[row].params.presence_penalty]
                              for row in counted], torch.float32, logits.device)[owner]
        flat[positions] = flat[positions] - (weights[:, 0] * count.to(torch.float32) + weights[:, 1])
    if suppressed:
        positions, _, _ = _token_positions([seqs[row].params.suppress_token_ids for row in suppressed], suppressed,
                                           vocab, logits.device)
        flat[positions] = float("-inf")
    return logits


def _token_positions(token_lists: list[list[int]], rows: list[int], vocab: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs of the given token lists, built on the host and sent in one copy.

    Returns:
        positions: int64 [n], row * vocab + token into the flattened [B, V] logits (rows[i] for token_lists[i]);
        owner: int64 [n], the index i of the list each position comes from;
        count: int64 [n], occurrences of the token in its list.
    """
    lengths = torch.tensor([len(tokens) for tokens in token_lists])
    owner = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    keys = owner * vocab + torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    keys, count = torch.unique(keys, return_counts=True)
    owner = keys // vocab
    positions = torch.tensor(rows)[owner] * vocab + keys % vocab
    moved = to_device(torch.stack([positions, owner, count]), torch.int64, device)
    return moved[0], moved[1], moved[2]
