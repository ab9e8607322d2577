"""Paged decode attention: one new query token per sequence against its paged KV cache.

Algorithm: split-KV "flash-decoding" (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context
inference", PyTorch blog / Stanford CRFM, 2023). Each sequence's KV range is cut into ``num_splits``
partitions (below); kernel 1 runs over the grid ``(B, num_kv_heads, num_splits)`` and, for all query
heads of one GQA group at once, computes the partial softmax statistics of its partition with the
online softmax of Milakov & Gimelshein, "Online normalizer calculation for softmax", arXiv:1805.02867
(2018): running max ``m``, running sum ``l`` and the unnormalised partial output ``acc``, all fp32.
Kernel 2 (grid ``(B, num_q_heads)``) rescales the partials to the global max and normalises:
``out = sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i`` with ``M = max_i m_i``.

Partitioning: program ``(b, h, s)`` loads ``context_lens[b]`` on the device, cuts the sequence into
``T = ceil(context_len / BLOCK_N)`` KV tiles (``BLOCK_N``: the kernel's KV tile, see ``_launch_config``)
and takes tiles ``[s * T // num_splits, (s + 1) * T // num_splits)``: near-equal runs (they differ by at
most one tile) that follow the sequence's own length, not the block table's width. Every split of a
sequence with ``T >= num_splits`` tiles does work; the splits of a shorter sequence that get no tile
write an empty partial (``m = -inf, l = 0``; their ``acc`` is neither written nor read), which the
reduce gives weight 0.

CUDA graphs: the grids and every launch argument depend only on tensor shapes, dtypes and
``num_splits``, never on ``context_lens`` values, so a captured launch stays valid for any lengths the
block tables can hold. With ``out`` and ``workspace`` passed, the wrapper allocates nothing and does
not synchronise, so it can be captured.

Choosing ``num_splits``: fix it per decode batch size, e.g. once per captured CUDA-graph bucket, with
:func:`default_num_splits` of the bucket's (padded) batch size, the model's KV heads and the block
table's capacity; it adds splits until kernel 1 has about 1024 programs, when the batch alone has
fewer. See that function for the reasoning.

Softmax is computed base 2 (``exp2`` of scores pre-multiplied by ``scale * log2(e)``), which is
mathematically identical to base e.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._paged import KVGather, check_int_tensor, check_kv_cache, check_launchable, gather_kv

LOG2E = 1.4426950408889634
_TARGET_PROGRAMS = 1024  # enough CTAs to fill a large GPU (H200: 132 SMs) several times over
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64


class DecodeWorkspace(NamedTuple):
    """fp32 scratch for the split partials; leading dims may exceed the batch (sliced to B), and any strides
    work, e.g. views ``[:, :, :num_splits]`` of a workspace allocated for the most splits, so one allocation
    serves every CUDA-graph bucket (``max_logit`` and ``sum_exp`` must share strides).

    max_logit, sum_exp: ``[>=B, num_q_heads, num_splits]``; partial_out:
    ``[>=B, num_q_heads, num_splits, head_dim]``. ``max_logit`` is in log2 units. After a call, a
    split with no KV tokens holds ``max_logit = -inf, sum_exp = 0`` and its ``partial_out`` is left
    as it was (never read).
    """

    max_logit: torch.Tensor
    sum_exp: torch.Tensor
    partial_out: torch.Tensor


def alloc_decode_workspace(
    batch: int, num_q_heads: int, head_dim: int, num_splits: int, device: torch.device | str
) -> DecodeWorkspace:
    """Allocate a :class:`DecodeWorkspace` (fp32) for batches up to ``batch`` rows."""
    return DecodeWorkspace(
        torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=device),
        torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=device),
        torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device),
    )


def default_num_splits(batch: int, num_kv_heads: int, max_context: int) -> int:
    """Static split count for a decode batch size: ``clamp(ceil(1024 / (batch * num_kv_heads)), 1,
    min(64, max_context // 256))``.

    Call it once per decode batch size the caller launches with, e.g. per captured CUDA-graph bucket
    with the bucket's padded size, and keep the result for every launch of that size (and the
    workspace allocated for it). It depends only on these static ints, never on context lengths.

    Reasoning (a rule from the work split, not tuned on hardware; ``scripts/bench_decode_kernel.py``
    times a sweep of ``num_splits`` to check it):

    * Kernel 1 runs ``batch * num_kv_heads * num_splits`` programs, and each reads ``~context /
      num_splits`` tokens. Decode is bound by the KV read, which needs enough programs to keep every
      SM streaming: splits are added until there are about 1024 programs (several per SM on a
      132-SM H100/H200; a batch that already has that many gets 1 split and no reduce kernel).
    * Each split costs an fp32 partial (``GROUP * head_dim`` values written, then read by the
      reduce); at least 256 tokens per split at full capacity keeps that traffic within
      ``GROUP / 128`` of the split's 16-bit K/V bytes (3 % at GQA group 4). Because partitions
      follow each sequence's own length, a sequence shorter than the capacity gets shorter
      partitions (down to one KV tile), and a split that gets no tile costs only an empty program
      and two stored floats per head, so sizing by capacity wastes little on short contexts.
    * At most 64 splits bounds the workspace and the reduce kernel's width.

    Args:
        batch: rows in the (possibly padded) batch.
        num_kv_heads: KV heads of the model (of one tensor-parallel rank).
        max_context: token capacity of a block-table row (``max_blocks_per_seq * block_size``, i.e. the
            model's context limit rounded up to a block).

    Returns:
        An int in ``[1, 64]``.
    """
    want = math.ceil(_TARGET_PROGRAMS / max(1, batch * num_kv_heads))
    cap = max(1, min(_MAX_SPLITS, max_context // _MIN_TOKENS_PER_SPLIT))
    return max(1, min(want, cap))


def _launch_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_D, BLOCK_N, num_warps, num_stages)`` for kernel 1.

    Chosen so that sm_90 cubins compiled ahead of time (triton.compile for GPUTarget("cuda", 90),
    resources read with cuobjdump --dump-resource-usage) use <= 255 registers with no spills for
    group sizes up to 16 at head_dim 64/128/256. fp32 (exact "ieee" dot) needs smaller KV tiles.
    Not tuned on hardware.
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        block_n = 32 if block_d <= 128 else 16
    else:
        block_n = 64 if block_d <= 128 else (32 if block_d <= 256 else 16)
    num_warps = 8 if block_d >= 128 else 4
    num_stages = 2 if dtype == torch.float32 else 3
    return block_d, block_n, num_warps, num_stages


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    m_ptr, l_ptr, acc_ptr, out_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bt,
    stride_mb, stride_mh, stride_ms,
    stride_ab, stride_ah, stride_as, stride_ad,
    stride_ob, stride_oh, stride_od,
    head_dim, num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # This split's share of the sequence's own KV tiles (module docstring): tiles
    # [split * T // num_splits, (split + 1) * T // num_splits), cut at context_len. int32 products:
    # exact while context_len * num_splits / BLOCK_N < 2**31 (any context below 2**29 tokens).
    context_len = tl.load(context_lens_ptr + b)
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    start = (split * num_tiles) // num_splits * BLOCK_N
    end = tl.minimum(((split + 1) * num_tiles) // num_splits * BLOCK_N, context_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + b * stride_bt
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        valid = pos < end
        # Per-token block lookup; masked positions never read the (possibly garbage) table entry.
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
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        # Every tile holds >= 1 valid position, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if DIRECT_OUT:
        # Single split: normalise here; an empty sequence (l = 0) yields zeros.
        denom = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / denom[:, None]
        tl.store(
            out_ptr + b * stride_ob + head[:, None] * stride_oh + d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        stat_off = b * stride_mb + head * stride_mh + split * stride_ms
        tl.store(m_ptr + stat_off, m_i, mask=g_mask)
        tl.store(l_ptr + stat_off, l_i, mask=g_mask)
        # An empty split (no token: l = 0, m = -inf; a token's own max adds exp2(0) = 1 to l) leaves acc
        # unwritten: the reduce does not read it.
        tl.store(
            acc_ptr + b * stride_ab + head[:, None] * stride_ah + split * stride_as + d[None, :] * stride_ad,
            acc, mask=(g_mask & (l_i > 0.0))[:, None] & d_mask[None, :],
        )


@triton.jit
def _decode_reduce_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr,
    stride_mb, stride_mh, stride_ms,
    stride_ab, stride_ah, stride_as, stride_ad,
    stride_ob, stride_oh, stride_od,
    head_dim, num_splits,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    s_mask = sp < num_splits
    d_mask = d < head_dim
    stat_off = b * stride_mb + head * stride_mh + sp * stride_ms
    m = tl.load(m_ptr + stat_off, mask=s_mask, other=float("-inf"))
    l = tl.load(l_ptr + stat_off, mask=s_mask, other=0.0)
    full = m > float("-inf")  # empty splits never wrote acc
    acc = tl.load(
        acc_ptr + b * stride_ab + head * stride_ah + sp[:, None] * stride_as + d[None, :] * stride_ad,
        mask=full[:, None] & d_mask[None, :], other=0.0,
    )
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty: avoid -inf - -inf
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) get weight 0
    l_sum = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0)
    o = o / tl.where(l_sum > 0.0, l_sum, 1.0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + d * stride_od, o.to(out_ptr.dtype.element_ty), mask=d_mask)


def _check(query, k_cache, v_cache, block_tables, context_lens, num_splits, out, workspace):
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"query must be [B, num_q_heads, {head_dim}], got {tuple(query.shape)}")
    batch, num_q_heads, _ = query.shape
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} != cache dtype {k_cache.dtype}")
    if query.device != k_cache.device:
        raise ValueError(f"query on {query.device} but cache on {k_cache.device}")
    check_int_tensor("block_tables", block_tables, torch.int32, (batch, None), query.device)
    check_int_tensor("context_lens", context_lens, torch.int32, (batch,), query.device)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.device != query.device):
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} on {query.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if workspace is not None:
        if num_splits is None:
            raise ValueError("pass num_splits together with workspace")
        want = ((num_q_heads, num_splits), (num_q_heads, num_splits), (num_q_heads, num_splits, head_dim))
        for name, t, tail in zip(DecodeWorkspace._fields, workspace, want):
            if t.dtype != torch.float32 or t.device != query.device or t.shape[1:] != tail or t.shape[0] < batch:
                raise ValueError(f"workspace.{name} must be fp32 [>={batch}, *{tail}] on {query.device}, "
                                 f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache (Triton split-KV flash-decoding).

    Args:
        query: ``[B, num_q_heads, head_dim]``, fp32/fp16/bf16 (same dtype as the cache); any strides.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
            ``num_q_heads`` must be a multiple of ``num_kv_heads`` (GQA group = ratio); query head
            ``h`` uses KV head ``h // group``.
        block_tables: int32 ``[B, max_blocks_per_seq]``; only the first
            ``ceil(context_lens[b] / block_size)`` entries of row b are read.
        context_lens: int32 ``[B]``, tokens of cached context per row (the current token's K/V
            must already be stored). ``0`` produces an all-zero output row (padded batch rows).
            Must be ``<= max_blocks_per_seq * block_size``; not checked (no device sync).
        scale: softmax scale applied to ``q . k`` (usually ``head_dim ** -0.5``).
        num_splits: KV partitions per sequence, each a near-equal share of that sequence's own
            ``context_lens[b]`` tokens (module docstring); ``None`` picks :func:`default_num_splits`
            from shapes. Results agree across values up to fp rounding.
        out: optional preallocated ``[B, num_q_heads, head_dim]`` output in query's dtype.
        workspace: optional :class:`DecodeWorkspace` (see :func:`alloc_decode_workspace`), needed
            to avoid allocation when ``num_splits > 1``; requires ``num_splits`` to be given.

    Returns:
        ``[B, num_q_heads, head_dim]`` in query's dtype (``out`` if given).

    Raises:
        ValueError: shape/dtype/device mismatches, bad ``num_splits``/``workspace``, or CPU tensors
            without ``TRITON_INTERPRET=1``.
    """
    _check(query, k_cache, v_cache, block_tables, context_lens, num_splits, out, workspace)
    check_launchable(query, k_cache)
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, max_context)
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    block_d, block_n, num_warps, num_stages = _launch_config(head_dim, query.dtype)
    direct = num_splits == 1
    if direct:
        m = l = acc = out  # unused placeholders
        m_strides, acc_strides = (0, 0, 0), (0, 0, 0, 0)
    else:
        if workspace is None:
            workspace = alloc_decode_workspace(batch, num_q_heads, head_dim, num_splits, query.device)
        m, l, acc = workspace
        if l.stride() != m.stride():
            raise ValueError("workspace.max_logit and workspace.sum_exp must have the same strides")
        m_strides, acc_strides = m.stride(), acc.stride()

    _decode_partial_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, context_lens,
        m, l, acc, out,
        scale * LOG2E,
        *query.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        *m_strides, *acc_strides, *out.stride(),
        head_dim, num_splits,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        IEEE_DOT=query.dtype == torch.float32,
        DIRECT_OUT=direct,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not direct:
        _decode_reduce_kernel[(batch, num_q_heads)](
            m, l, acc, out,
            *m_strides, *acc_strides, *out.stride(),
            head_dim, num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out


def paged_decode_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    gather: KVGather | None = None,
) -> torch.Tensor:
    """Torch version of :func:`paged_decode_attention` (same contract); the engine's CPU path.

    ``gather``: :func:`kernels._paged.kv_gather` of ``(block_tables, context_lens, max(context_lens))``,
    which is the same for every layer of a step: the torch attention backend computes it once per step.

    Vectorised over the batch: gathers K/V up to ``max(context_lens)`` (one device sync) heads first, then
    runs torch's fused ``scaled_dot_product_attention`` with the padding masked out. Its CPU kernel
    (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) keeps the precision of this module's kernel: scores and
    softmax in fp32, probabilities cast to the input dtype for ``P @ V`` with fp32 accumulation, the result in
    the input dtype; and it never materialises fp32 copies of K or the ``[B, H, L]`` scores.
    ``num_splits`` and ``workspace`` are validated but otherwise ignored.
    Memory: ``O(B * max_context * num_kv_heads * head_dim)``.
    """
    _check(query, k_cache, v_cache, block_tables, context_lens, num_splits, out, workspace)
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    max_len = gather.valid.shape[1] if gather is not None else int(context_lens.max().item()) if batch > 0 else 0
    if max_len == 0:
        result = torch.zeros_like(query)
    else:
        k, v, valid = gather_kv(k_cache, v_cache, block_tables, context_lens, max_len, gather)
        # A GQA group's query heads are the query rows of its KV head: [B, Hkv, group, D] against [B, Hkv, L, D]
        q = query.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # query dtype == cache dtype
        result = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :],
                                                scale=scale).reshape(batch, num_q_heads, head_dim)
        # Rows with context_len 0 (every position masked: NaN) are defined as zeros.
        result = torch.where((context_lens > 0)[:, None, None], result, 0.0)
    if out is None:
        return result
    out.copy_(result)
    return out
