"""Tensor helpers of the sampler: argmax and top candidates by blocks of the vocabulary, sums of exponentials,
row selection, and host/device transfers in one copy."""

from __future__ import annotations

import math

import torch

CPU_BLOCK_ELEMENTS = 1 << 19
"""On the CPU a pass over whole vocabularies goes over blocks of rows of about this many float32 (2 MiB, a core's
L2 here) in one buffer allocated per pass: the normalizer of [64, 128256] took 3-4 ms that way against 13.6 ms
for the batch at once, and a fresh buffer per block cost as much again."""


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), the first index of each row's maximum, by blocks of `width` tokens: the first block
    whose maximum is the row's, then the first index of the maximum inside it. Vectorized maxima instead of
    argmax's index-tracking loop (CPU, [64, 128256]: 0.84 against 7.0 ms; [64, 49152]: 0.39 against 2.7 ms).

    Args:
        x: float32 [m, V], contiguous.
    Returns:
        int64 [m]. A row holding a NaN gets 0 (argmax would give its first NaN).
    """
    rows, vocab = x.shape
    width = 128
    while vocab % width:
        width //= 2
    if width < 32:
        return x.argmax(dim=-1)
    blocks = x.view(rows, vocab // width, width)
    block_max = blocks.amax(dim=2)
    best = block_max.amax(dim=1, keepdim=True)
    first = (block_max == best).to(torch.uint8).argmax(dim=1)
    inside = (blocks[torch.arange(rows, device=x.device), first] == best).to(torch.uint8).argmax(dim=1)
    return first * width + inside


def top_candidates(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row, in descending order.

    Args:
        x: float32 [m, V], contiguous; k <= V.
    Returns:
        (values float32 [m, k], token ids int64 [m, k]): the values are torch.topk's; among equal values the ids
        may come in another order.

    Two stages when V is large against k: view each row as `width` blocks of C = V / width tokens, take the
    maximum over the blocks for every group {g, g + C, g + 2C, ...}, keep the k groups with the largest maxima
    and take the top k of their k * width entries. Exact: an entry outside the kept groups is <= its group's
    maximum <= the k-th largest kept maximum, and the k kept maxima are k distinct kept entries. It reads the
    row once with a vectorized max and runs torch.topk's selection over V / width + k * width entries instead
    of V. width = the power of two at most sqrt(V / k) / 2 (measured best on one CPU thread: [64, 49152], k 64:
    width 8, 2.7 ms against 6.4 ms for torch.topk; [64, 128256]: width 16, 3.4 against 13.8 ms).
    """
    rows, vocab = x.shape
    width = 1 << max(0, int(math.log2(math.sqrt(vocab / k) / 2)))
    while vocab % width:
        width //= 2
    if width < 4:
        return x.topk(k, dim=-1)
    groups = vocab // width
    best = x.view(rows, width, groups).amax(dim=1).topk(k, dim=-1).indices
    candidates = (best.unsqueeze(2) + groups * torch.arange(width, device=x.device)).view(rows, k * width)
    values, picked = x.gather(1, candidates).topk(k, dim=-1)
    return values, candidates.gather(1, picked)


def exp_sums(x: torch.Tensor, top: torch.Tensor, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """Per row sum over the vocabulary of exp(x / T - top) (exp(x - top) without a temperature): the softmax
    denominator relative to `top`, the row's largest (scaled) logit.

    Args:
        x: float32 [m, V]; top, temperature: float32 [m, 1].
    Returns:
        float32 [m].
    """
    out = torch.empty(x.shape[0], device=x.device)
    for block, scratch in row_blocks(x):
        if temperature is None:
            torch.sub(x[block], top[block], out=scratch)
        else:
            torch.div(x[block], temperature[block], out=scratch).sub_(top[block])
        torch.sum(scratch.exp_(), dim=-1, out=out[block])
    return out


def row_blocks(x: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
    """Row blocks of x [m, V] for a pass over whole vocabularies, each with a float32 scratch [rows, V]: one
    block on CUDA; on the CPU blocks of about CPU_BLOCK_ELEMENTS sharing one scratch buffer."""
    rows, vocab = x.shape
    size = rows if x.device.type == "cuda" else max(1, min(rows, CPU_BLOCK_ELEMENTS // vocab))
    scratch = torch.empty(size, vocab, device=x.device)
    return [(slice(start, start + size), scratch[:min(size, rows - start)]) for start in range(0, rows, size)]


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] along dim 0; t itself when rows are all of its rows in order."""
    if rows == list(range(t.shape[0])):
        return t
    return t.index_select(0, to_device(rows, torch.int64, t.device))


def put_rows(t: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    """t[rows] = values along dim 0."""
    if rows == list(range(t.shape[0])):
        t.copy_(values)
    else:
        t.index_copy_(0, to_device(rows, torch.int64, t.device), values)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (nested lists or a CPU tensor) as a tensor on `device`; to CUDA through pinned memory, so the
    copy is queued behind the stream's work instead of waiting for it."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> list[list[float]]:
    """The tensors' values as flat Python lists, in one device-to-host copy (packed as float64: exact for
    float32 values and for integers below 2**53)."""
    flat = torch.cat([t.reshape(-1).double() for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        out.append(flat[start:start + t.numel()])
        start += t.numel()
    return out
