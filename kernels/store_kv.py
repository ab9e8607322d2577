"""Write new tokens' keys and values into the paged KV cache.

One program per token copies that token's ``[num_kv_heads, head_dim]`` key and value tile to
slot ``slot_mapping[t]``, i.e. ``cache[slot // block_size, slot % block_size]``. Slot ``-1`` marks
a padding token (e.g. the padded rows of a CUDA-graph batch) and is skipped. All addressing goes
through tensor strides, so caches that are strided views (e.g. halves of one K/V allocation) work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._paged import check_int_tensor, check_kv_cache, check_launchable


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    heads = tl.where(slot >= 0, num_kv_heads, 0)  # padding token (slot -1): mask everything off
    mask = (h[:, None] < heads) & (d[None, :] < head_dim)

    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + h[:, None] * stride_kch + d[None, :] * stride_kcd
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + h[:, None] * stride_vch + d[None, :] * stride_vcd
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def _check(key, value, k_cache, v_cache, slot_mapping) -> None:
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"key must be [T, {num_kv_heads}, {head_dim}], got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        raise ValueError(f"key/value dtype ({key.dtype}, {value.dtype}) must equal cache dtype {k_cache.dtype}")
    if key.device != k_cache.device or value.device != k_cache.device:
        raise ValueError("key, value and the caches must be on one device")
    check_int_tensor("slot_mapping", slot_mapping, torch.int64, (key.shape[0],), k_cache.device)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` into the paged caches in place (Triton kernel).

    Args:
        key, value: ``[T, num_kv_heads, head_dim]``, same dtype as the caches.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, fp32/fp16/bf16.
        slot_mapping: int64 ``[T]``; slot ``block_id * block_size + offset`` per token, or ``-1``
            to skip the token. Slots must be ``< num_blocks * block_size`` and distinct (duplicate
            slots give an unspecified winner); not checked, to avoid a device sync.

    Returns:
        None. The caches are modified in place.

    Raises:
        ValueError: on shape, dtype or device mismatch, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _check(key, value, k_cache, v_cache, slot_mapping)
    check_launchable(key, k_cache)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return None
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return None


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch version of :func:`store_kv` (same contract); the engine's CPU path.

    Uses advanced-index assignment ``cache[block, offset] = key`` so strided cache views are
    written in place. Selecting the non-negative slots costs a device sync on CUDA.
    """
    _check(key, value, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block, offset = slots // block_size, slots % block_size
    k_cache[block, offset] = key[keep]
    v_cache[block, offset] = value[keep]
    return None
