"""Paged prefill attention: causal attention of new (possibly chunked) prompt tokens over the cache.

The new tokens' K/V are already in the cache (see :mod:`kernels.store_kv`), so one code path serves
a whole prompt and a later chunk of a chunked prefill: query ``j`` of sequence ``s`` sits at
position ``context_lens[s] - q_len_s + j`` and attends to cached positions ``<=`` that.

Kernel: FlashAttention-style tiling (Dao et al., "FlashAttention", arXiv:2205.14135, 2022; Dao,
"FlashAttention-2", arXiv:2307.08691, 2023) with the online softmax of Milakov & Gimelshein
(arXiv:1805.02867, 2018), K/V read through the block table token by token. Grid
``(num_q_tiles, num_q_heads)`` with ``num_q_tiles = T // BLOCK_M + S``: sequence ``s`` owns tiles
``[q_start[s] // BLOCK_M + s, ... + ceil(q_len_s / BLOCK_M))``; that bound never overlaps the next
sequence's first tile, so the count is static in ``T`` and ``S`` (no host sync to size the grid).
Each program finds its sequence by binary search over ``query_start_loc``; surplus programs exit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._paged import check_int_tensor, check_kv_cache, check_launchable, gather_kv

LOG2E = 1.4426950408889634


def _launch_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """``(BLOCK_D, BLOCK_M, BLOCK_N, num_warps, num_stages)``.

    Chosen so that sm_90 cubins compiled ahead of time (triton.compile for GPUTarget("cuda", 90),
    cuobjdump --dump-resource-usage) have no register spills at head_dim 64/128/256; fp32 (exact
    "ieee" dot) needs smaller tiles: with triton 3.7.1 a 32-row fp32 tile at head_dim 128 spilled
    (48 B of stack), 16 rows do not. Not tuned on hardware.
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        block_m, block_n = (32, 16) if block_d <= 64 else (16, 16)
    else:
        block_m, block_n = (64, 32) if block_d <= 128 else (32, 16)
    num_warps = 8 if block_d >= 64 else 4
    num_stages = 2 if dtype == torch.float32 else 3
    return block_d, block_m, block_n, num_warps, num_stages


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr, out_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    num_seqs, head_dim,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    tile_id = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    # Largest s in [0, num_seqs) with first_tile(s) = query_start_loc[s] // BLOCK_M + s <= tile_id.
    lo = tile_id * 0  # int32 tensors, so the loop-carried types stay fixed
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
        go_right = first <= tile_id
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = tile_id - (q_start // BLOCK_M + seq)
    if local * BLOCK_M < q_len:
        context_len = tl.load(context_lens_ptr + seq)
        first_pos = context_len - q_len  # position of this sequence's first new token
        m_off = local * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = m_off < q_len
        q_pos = first_pos + m_off
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_dim
        tok = (q_start + m_off).to(tl.int64)
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd,
            mask=m_mask[:, None] & d_mask[None, :], other=0.0,
        )

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Causal bound: the last valid query row of this tile sees positions < kv_end.
        kv_end = first_pos + tl.minimum((local + 1) * BLOCK_M, q_len)
        n = tl.arange(0, BLOCK_N)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for tile in range(0, kv_end, BLOCK_N):
            pos = tile + n
            valid = pos < kv_end
            block_id = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            offset = pos % BLOCK_SIZE
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(
                k_cache_ptr + block_id[:, None] * stride_kb + offset[:, None] * stride_ko
                + kv_head * stride_kh + d[None, :] * stride_kd,
                mask=kv_mask, other=0.0,
            )
            v = tl.load(
                v_cache_ptr + block_id[:, None] * stride_vb + offset[:, None] * stride_vo
                + kv_head * stride_vh + d[None, :] * stride_vd,
                mask=kv_mask, other=0.0,
            )
            if IEEE_DOT:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            keep = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            s = tl.where(keep, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # Guard rows that have seen no key yet (m_new = -inf) against inf - inf = NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :],
        )


def _check(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, float32_query: bool = False) -> None:
    """Raise ValueError on arguments outside the contract; `float32_query`: a float32 query over a cache of any dtype
    is allowed too (the reference's widening, see `paged_prefill_attention_reference`)."""
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"query must be [T, num_q_heads, {head_dim}], got {tuple(query.shape)}")
    if query.shape[1] % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype != k_cache.dtype and not (float32_query and query.dtype == torch.float32):
        raise ValueError(f"query dtype {query.dtype} != cache dtype {k_cache.dtype}")
    if query.device != k_cache.device:
        raise ValueError(f"query on {query.device} but cache on {k_cache.device}")
    if context_lens.dim() != 1:
        raise ValueError(f"context_lens must be 1-D [S], got {tuple(context_lens.shape)}")
    num_seqs = context_lens.shape[0]
    check_int_tensor("context_lens", context_lens, torch.int32, (num_seqs,), query.device)
    check_int_tensor("query_start_loc", query_start_loc, torch.int32, (num_seqs + 1,), query.device)
    check_int_tensor("block_tables", block_tables, torch.int32, (num_seqs, None), query.device)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal prefill / chunked-prefill attention over a paged KV cache (Triton).

    Args:
        query: ``[T, num_q_heads, head_dim]``, the new tokens of S sequences concatenated;
            fp32/fp16/bf16, same dtype as the cache; any strides.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already holding the
            new tokens' K/V. ``num_q_heads`` must be a multiple of ``num_kv_heads``.
        block_tables: int32 ``[S, max_blocks_per_seq]``; only the first
            ``ceil(context_lens[s] / block_size)`` entries of row s are read.
        query_start_loc: int32 ``[S + 1]``, cumulative new-token counts (``[0, q_len_0, ...]``,
            last entry ``T``). A sequence may have 0 new tokens.
        context_lens: int32 ``[S]``, total KV length of each sequence including its new tokens;
            must satisfy ``q_len_s <= context_lens[s] <= max_blocks_per_seq * block_size``
            (not checked: no device sync).
        scale: softmax scale applied to ``q . k``.

    Returns:
        ``[T, num_q_heads, head_dim]`` in query's dtype.

    Raises:
        ValueError: shape/dtype/device mismatches, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _check(query, k_cache, v_cache, block_tables, query_start_loc, context_lens)
    check_launchable(query, k_cache)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_d, block_m, block_n, num_warps, num_stages = _launch_config(head_dim, query.dtype)
    grid = (num_tokens // block_m + num_seqs, num_q_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, query_start_loc, context_lens, out,
        scale * LOG2E,
        *query.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        num_seqs, head_dim,
        GROUP=num_q_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        IEEE_DOT=query.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def paged_prefill_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch version of :func:`paged_prefill_attention` (same contract); the engine's CPU path. It also takes a
    float32 query over a bfloat16 or float16 cache (the C++ CPU step's float32 queries): the gathered K/V are widened
    to float32 and the attention runs in float32 (torch's CPU attention in float32 took 15.5 ms for one SmolLM2
    layer of a 1,000-token prompt against 25.5 ms in bfloat16 on the Intel Xeon without AMX), output float32.

    Loops over sequences (one host sync for the lengths); within a sequence everything is vectorised: gather
    its K/V heads first, then torch's fused ``scaled_dot_product_attention`` (same precision as the kernel,
    see :func:`kernels.paged_decode.paged_decode_attention_reference`), causal with the queries aligned to the
    end of the context: query ``i`` sits at position ``context_len - q_len + i`` and sees keys up to it.

    Raises:
        ValueError: as :func:`paged_prefill_attention`, plus ``q_len_s > context_lens[s]``.
    """
    _check(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, float32_query=True)
    num_tokens, num_q_heads, head_dim = query.shape
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for s, ctx in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        if q_len > ctx:
            raise ValueError(f"sequence {s}: {q_len} new tokens but context_lens is {ctx}")
        k, v, _ = gather_kv(k_cache, v_cache, block_tables[s : s + 1], context_lens[s : s + 1], ctx)
        k, v = k.to(query.dtype), v.to(query.dtype)  # no-ops unless a float32 query over a 16-bit cache
        q = query[q0:q1].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        if q_len == ctx:  # no cached prefix: SDPA's own (top-left aligned) causal mask is the same
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
            mask = torch.arange(ctx, device=query.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[q0:q1] = o[0].transpose(0, 1)
    return out
