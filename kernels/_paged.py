"""Helpers shared by the paged-KV-cache kernels: input checks and the torch gather used by references.

Cache layout (fixed by the engine): per layer ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot ``s`` lives at
``cache[s // block_size, s % block_size]``. Block tables are int32 ``[B, max_blocks_per_seq]``;
entries past a sequence's length may be garbage and are never used to address the cache.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate a K/V cache pair; return ``(num_blocks, block_size, num_kv_heads, head_dim)``.

    Raises:
        ValueError: not 4-D, block_size, num_kv_heads or head_dim below 1 (kernels divide by the first two), shapes/
            dtypes/devices differ, or dtype not fp32/fp16/bf16.
    """
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}")
    if min(k_cache.shape[1:]) < 1:
        raise ValueError(f"k_cache's block_size, num_kv_heads and head_dim must be at least 1, got "
                         f"{tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"cache dtypes must match and be fp32/fp16/bf16, got {k_cache.dtype}, {v_cache.dtype}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"k_cache on {k_cache.device} but v_cache on {v_cache.device}")
    return tuple(k_cache.shape)  # type: ignore[return-value]


def check_int_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    """Raise ValueError unless ``t`` has exactly ``dtype``, ``shape`` (None = any size) and ``device``,
    and unit stride in its last dimension (kernels index rows as ``ptr + i``)."""
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        raise ValueError(f"{name} must have shape {shape} (None = any), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides {t.stride()}")


def check_launchable(*tensors: torch.Tensor) -> None:
    """Raise ValueError if a Triton kernel cannot run on these tensors.

    Triton kernels need CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1`` set before
    ``triton`` was imported. On CPU the engine should call the ``*_reference`` functions instead.
    """
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    for t in tensors:
        if t.device.type != "cuda" and not interpret:
            raise ValueError(
                f"Triton kernel got a {t.device} tensor; use CUDA tensors, set TRITON_INTERPRET=1, "
                "or call the *_reference function (the CPU path)"
            )


class KVGather(NamedTuple):
    """Where the first ``lengths[b]`` tokens of each sequence live in the paged cache (see :func:`kv_gather`).

    Attributes:
        slots: int64 ``[B, L]`` cache slot of each position; padding positions repeat the row's first slot.
        valid: bool ``[B, L]``, True for the ``lengths[b]`` real positions of row b.
    """

    slots: torch.Tensor
    valid: torch.Tensor


def kv_gather(block_tables: torch.Tensor, lengths: torch.Tensor, max_len: int, block_size: int) -> KVGather:
    """The cache slots a batch reads: the same for every layer, so a caller may compute it once per step.

    Args:
        block_tables: int32 ``[B, max_blocks_per_seq]``; entries past ``lengths[b]`` are never used.
        lengths: integer ``[B]``, tokens to read per row (on the block tables' device).
        max_len: Python int >= max(lengths): the padded length ``L``.
        block_size: tokens per cache block.

    Padding positions repeat the row's first token, so they hold finite data and a zero softmax weight keeps
    them out of the result; rows with ``lengths[b] == 0`` read slot 0 (possibly garbage): callers must zero
    those rows.
    """
    device = block_tables.device
    lengths = lengths.to(device=device, dtype=torch.long)
    pos = torch.arange(max_len, device=device)
    valid = pos[None, :] < lengths[:, None]  # [B, L]
    block_idx = torch.where(valid, pos[None, :] // block_size, 0)
    slots = torch.gather(block_tables.long(), 1, block_idx) * block_size + pos[None, :] % block_size
    first = torch.where(lengths > 0, block_tables[:, 0].long() * block_size, 0)
    return KVGather(torch.where(valid, slots, first[:, None]), valid)


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
    gather: KVGather | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Materialise the first ``lengths[b]`` tokens of each sequence from the paged cache, heads first.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: int32 ``[B, max_blocks_per_seq]``.
        lengths: integer ``[B]``, tokens to read per row (on the cache's device).
        max_len: Python int >= max(lengths): the padded length ``L`` of the result.
        gather: :func:`kv_gather` of these block tables and lengths, if the caller already has it.

    Returns:
        ``(k, v, valid)``: k, v contiguous ``[B, num_kv_heads, L, head_dim]`` in the cache dtype (the layout
        batched matmuls take without a copy: ``k.transpose(-1, -2)`` is a view) and bool ``valid [B, L]``;
        padding as in :func:`kv_gather`.
    """
    if gather is None:
        gather = kv_gather(block_tables, lengths, max_len, k_cache.shape[1])
    return _take(k_cache, gather.slots), _take(v_cache, gather.slots), gather.valid


def _take(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[slot // block_size, slot % block_size, h]`` for int64 ``slots [B, L]`` -> ``[B, H, L, D]``.

    A cache whose (block, offset, head) dimensions merge into one row index (the engine's contiguous cache)
    is read with one ``index_select`` of rows ``slot * H + h``, straight into the heads-first layout.
    """
    num_blocks, block_size, heads, head_dim = cache.shape
    if cache.stride(1) == heads * cache.stride(2) and cache.stride(0) == block_size * cache.stride(1):
        rows = cache.as_strided((num_blocks * block_size * heads, head_dim), (cache.stride(2), cache.stride(3)))
        index = slots[:, None, :] * heads + torch.arange(heads, device=slots.device)[None, :, None]  # [B, H, L]
        return rows.index_select(0, index.reshape(-1)).view(*index.shape, head_dim)
    return cache[slots // block_size, slots % block_size].transpose(1, 2).contiguous()
