"""paged_prefill_attention: Triton vs torch reference vs naive float64 causal attention."""

import pytest
import torch
from kernel_testing import ATOL, DEVICE, DTYPES, PagedKV, assert_close, default_scale, naive_attention

from kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_reference

NUM_KV_HEADS = 2
# (num_q_heads, num_kv_heads, head_dim) of the served models: SmolLM2-135M and an 8B Llama-3-class model.
PRODUCTION_HEADS = {"135m": (9, 3, 64), "8b": (32, 8, 128)}


def _setup(q_lens, ctx_lens, block_size, group, head_dim, dtype, seed=0, num_kv_heads=NUM_KV_HEADS,
           table_width=None):
    gen = torch.Generator().manual_seed(seed)
    kv = PagedKV(ctx_lens, block_size, num_kv_heads, head_dim, dtype, gen, table_width=table_width)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    return kv, query, starts, torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)


def _naive(kv, query, q_lens, ctx_lens, scale):
    out, t = torch.zeros_like(query, dtype=torch.float64), 0
    for i, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens)):
        k, v = kv.sequence(i, ctx)
        q_pos = list(range(ctx - q_len, ctx))
        out[t : t + q_len] = naive_attention(query[t : t + q_len], k, v, q_pos, scale)
        t += q_len
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_reference_and_naive(block_size, group, dtype):
    head_dim = 16
    # (new tokens, total context): single token; full prompt not a block multiple; chunk after a
    # cached prefix; prompt longer than one query tile (BLOCK_M <= 64); no new tokens; one token after a prefix.
    pairs = [(1, 1), (13, 13), (7, 40), (70, 70), (0, 20), (1, 37)]
    q_lens, ctx_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    kv, query, starts, context_lens = _setup(q_lens, ctx_lens, block_size, group, head_dim, dtype)
    scale = default_scale(head_dim)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, starts, context_lens, scale)

    ref = paged_prefill_attention_reference(*args)
    assert ref.dtype == dtype and ref.shape == query.shape
    assert_close(ref, _naive(kv, query, q_lens, ctx_lens, scale), ATOL[dtype], "reference vs float64")
    got = paged_prefill_attention(*args)
    assert got.dtype == dtype and got.shape == query.shape
    assert_close(got, ref, ATOL[dtype], "kernel vs reference")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", sorted(PRODUCTION_HEADS))
def test_prefill_production_head_shapes(model, dtype):
    """The served models' heads (GQA group 3 at head_dim 64, group 4 at 128): a one-token prompt, a chunk after a
    cached prefix, a whole prompt, over a table wider than the contexts. Tiny for the interpreter."""
    num_q_heads, num_kv_heads, head_dim = PRODUCTION_HEADS[model]
    pairs = [(1, 1), (7, 40), (13, 13)]
    q_lens, ctx_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    kv, query, starts, context_lens = _setup(q_lens, ctx_lens, 16, num_q_heads // num_kv_heads, head_dim, dtype,
                                             seed=7, num_kv_heads=num_kv_heads, table_width=16)
    scale = default_scale(head_dim)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, starts, context_lens, scale)
    ref = paged_prefill_attention_reference(*args)
    assert_close(ref, _naive(kv, query, q_lens, ctx_lens, scale), ATOL[dtype], "reference vs float64")
    assert_close(paged_prefill_attention(*args), ref, ATOL[dtype], f"{model} kernel vs reference")


def test_prefill_strided_query_odd_head_dim():
    head_dim, group = 24, 2
    q_lens, ctx_lens = [5, 66], [21, 66]
    kv, _, starts, context_lens = _setup(q_lens, ctx_lens, 16, group, head_dim, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(sum(q_lens), NUM_KV_HEADS * group + 4, head_dim, generator=gen).to(DEVICE)
    query = qkv[:, 2 : 2 + NUM_KV_HEADS * group]
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, starts, context_lens, 0.2)
    ref = paged_prefill_attention_reference(*args)
    assert_close(ref, _naive(kv, query, q_lens, ctx_lens, 0.2), ATOL[torch.float32], "reference vs float64")
    assert_close(paged_prefill_attention(*args), ref, ATOL[torch.float32], "kernel vs reference")


@pytest.mark.parametrize("fn", [paged_prefill_attention, paged_prefill_attention_reference])
def test_prefill_rejects_bad_inputs(fn):
    kv, query, starts, context_lens = _setup([3, 4], [3, 9], 16, 2, 16, torch.float32)
    base = dict(query=query, k_cache=kv.k_cache, v_cache=kv.v_cache, block_tables=kv.block_tables,
                query_start_loc=starts, context_lens=context_lens, scale=1.0)
    bad = [
        dict(query_start_loc=starts.long()),
        dict(query_start_loc=starts[:2]),
        dict(context_lens=context_lens.long()),
        dict(block_tables=kv.block_tables[:1]),
        dict(query=query[:, :3]),
        dict(query=query.half()),
    ]
    for override in bad:
        with pytest.raises(ValueError):
            fn(**{**base, **override})


def test_prefill_reference_rejects_more_new_tokens_than_context():
    kv, query, starts, _ = _setup([3, 4], [3, 9], 16, 2, 16, torch.float32)
    bad_ctx = torch.tensor([3, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="new tokens"):
        paged_prefill_attention_reference(query, kv.k_cache, kv.v_cache, kv.block_tables, starts, bad_ctx, 1.0)


def test_prefill_reference_float32_query_over_bf16_cache():
    """The C++ CPU step's prefill: float32 queries over a bfloat16 cache run in float32 on the widened K/V, the
    same as over float32 caches holding those values, and within float32's tolerance of float64; the Triton kernel
    keeps one dtype."""
    pairs = [(13, 13), (7, 40), (1, 37)]
    q_lens, ctx_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    kv, query, starts, context_lens = _setup(q_lens, ctx_lens, 16, 3, 64, torch.bfloat16)
    query = query.float() + 1e-3 * torch.randn(query.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    scale = default_scale(64)
    got = paged_prefill_attention_reference(query, kv.k_cache, kv.v_cache, kv.block_tables, starts, context_lens,
                                            scale)
    assert got.dtype == torch.float32
    want = paged_prefill_attention_reference(query, kv.k_cache.float(), kv.v_cache.float(), kv.block_tables, starts,
                                             context_lens, scale)
    assert torch.equal(got, want)
    kv.k_cache, kv.v_cache = kv.k_cache.float(), kv.v_cache.float()  # the float64 reference reads the same values
    assert_close(got, _naive(kv, query, q_lens, ctx_lens, scale), ATOL[torch.float32], "reference vs float64")
    with pytest.raises(ValueError, match="dtype"):
        paged_prefill_attention(query, kv.k_cache.bfloat16(), kv.v_cache.bfloat16(), kv.block_tables, starts,
                                context_lens, scale)
