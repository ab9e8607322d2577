"""paged_decode_attention: Triton vs torch reference vs naive float64 attention on NaN-poisoned caches."""

import pytest
import torch
from kernel_testing import (ATOL, DEVICE, DTYPES, INTERPRET, PagedKV, assert_close, bad_decode_overrides, default_scale,
                            naive_attention)

from kernels.paged_decode import (
    alloc_decode_workspace,
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
    tokens_per_split,
)

NUM_KV_HEADS = 2


def _setup(lens, block_size, group, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = PagedKV(lens, block_size, NUM_KV_HEADS, head_dim, dtype, gen)
    query = torch.randn(len(lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(DEVICE, dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return kv, query, context_lens


def _naive(kv, query, lens, scale):
    rows = []
    for i, n in enumerate(lens):
        k, v = kv.sequence(i, n)
        rows.append(naive_attention(query[i : i + 1], k, v, [n - 1], scale)[0])
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference_and_naive(block_size, group, dtype):
    head_dim = 32
    # 1 token, a partial block, a non-multiple, and one spanning three splits of num_splits=3.
    lens = [1, block_size - 3, 37, 150]
    kv, query, context_lens = _setup(lens, block_size, group, head_dim, dtype)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, default_scale(head_dim))
    max_context = kv.block_tables.shape[1] * block_size
    assert 150 > tokens_per_split(max_context, 3, head_dim, dtype), "test must cover a multi-split sequence"

    ref = paged_decode_attention_reference(*args)
    assert ref.dtype == dtype and ref.shape == query.shape
    assert_close(ref, _naive(kv, query, lens, default_scale(head_dim)), ATOL[dtype], "reference vs float64")
    for num_splits in (1, 3, None):
        got = paged_decode_attention(*args, num_splits=num_splits)
        assert got.dtype == dtype and got.shape == query.shape
        assert_close(got, ref, ATOL[dtype], f"kernel num_splits={num_splits}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_num_splits_agree(dtype):
    head_dim = 16
    lens = [200, 5, 129]
    kv, query, context_lens = _setup(lens, 16, 4, head_dim, dtype, seed=1)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, default_scale(head_dim))
    results = [paged_decode_attention(*args, num_splits=n) for n in (1, 2, 4, 7)]
    for n, r in zip((2, 4, 7), results[1:]):
        assert_close(r, results[0], ATOL[dtype], f"num_splits={n} vs 1")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_zero_context_rows_are_zero(num_splits):
    head_dim = 16
    lens = [0, 20, 0, 70]
    kv, query, context_lens = _setup(lens, 16, 4, head_dim, torch.float32, seed=2)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, default_scale(head_dim))
    ref = paged_decode_attention_reference(*args)
    got = paged_decode_attention(*args, num_splits=num_splits)
    for out in (ref, got):
        assert not torch.isnan(out).any()
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert_close(got, ref, ATOL[torch.float32], "kernel vs reference")
    # A batch made only of padding rows (max context 0) works too.
    none = torch.zeros_like(context_lens)
    for fn in (paged_decode_attention, paged_decode_attention_reference):
        out = fn(query, kv.k_cache, kv.v_cache, kv.block_tables, none, 1.0, num_splits=num_splits)
        assert torch.equal(out, torch.zeros_like(out))


def test_decode_preallocated_buffers_and_strided_query():
    """out/workspace larger than the batch (CUDA-graph style), a strided query, head_dim not a power of 2."""
    head_dim, group, num_splits = 24, 2, 3
    lens = [9, 40, 100]
    kv, _, context_lens = _setup(lens, 16, group, head_dim, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(len(lens), NUM_KV_HEADS * group + 7, head_dim, generator=gen).to(DEVICE)
    query = qkv[:, 3 : 3 + NUM_KV_HEADS * group]  # non-contiguous view
    scale = 0.3
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, scale)
    ref = paged_decode_attention_reference(*args)
    assert_close(ref, _naive(kv, query, lens, scale), ATOL[torch.float32], "reference vs float64")

    big_out = torch.full((8, query.shape[1], head_dim), float("nan"), device=DEVICE)
    out = big_out[: len(lens)]
    ws = alloc_decode_workspace(8, query.shape[1], head_dim, num_splits, DEVICE)
    got = paged_decode_attention(*args, num_splits=num_splits, out=out, workspace=ws)
    assert got is out
    assert_close(out, ref, ATOL[torch.float32], "kernel into preallocated out")
    assert torch.isnan(big_out[len(lens):]).all(), "rows past the batch must not be written"
    ref_out = torch.empty_like(out)
    assert paged_decode_attention_reference(*args, out=ref_out) is ref_out


def test_default_num_splits_is_static_and_bounded():
    assert default_num_splits(64, 8, 4096) == 2
    assert default_num_splits(1, 8, 32768) == 64
    assert default_num_splits(256, 8, 4096) == 1
    assert default_num_splits(1, 1, 100) == 1


@pytest.mark.parametrize("fn", [paged_decode_attention, paged_decode_attention_reference])
def test_decode_rejects_bad_inputs(fn):
    kv, query, context_lens = _setup([5, 9], 16, 2, 16, torch.float32)
    base = dict(query=query, k_cache=kv.k_cache, v_cache=kv.v_cache, block_tables=kv.block_tables,
                context_lens=context_lens, scale=1.0)
    bad = bad_decode_overrides(kv, query, context_lens)
    for override in bad:
        with pytest.raises(ValueError):
            fn(**{**base, **override})


@pytest.mark.skipif(DEVICE != "cpu" or not INTERPRET, reason="checks the CPU/interpreter guard")
def test_decode_cpu_without_interpreter_raises(monkeypatch):
    kv, query, context_lens = _setup([5], 16, 1, 16, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="reference"):
        paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, 1.0)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_decode_cuda_graph_replay_follows_new_inputs():
    """Capture once with static buffers, then change lengths/queries and replay (engine usage)."""
    head_dim, group, num_splits, dtype = 64, 4, 4, torch.float16
    lens_a, lens_b = [5, 100, 33, 0], [140, 1, 0, 77]
    kv, query, _ = _setup([max(a, b) for a, b in zip(lens_a, lens_b)], 16, group, head_dim, dtype, seed=7)
    scale = default_scale(head_dim)
    static_q = query.clone()
    static_ctx = torch.tensor(lens_a, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(query)
    ws = alloc_decode_workspace(len(lens_a), query.shape[1], head_dim, num_splits, DEVICE)
    args = (static_q, kv.k_cache, kv.v_cache, kv.block_tables, static_ctx, scale)

    paged_decode_attention(*args, num_splits=num_splits, out=out, workspace=ws)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, num_splits=num_splits, out=out, workspace=ws)
    for seed, lens in enumerate((lens_a, lens_b)):
        static_ctx.copy_(torch.tensor(lens, dtype=torch.int32))
        static_q.copy_(torch.randn(query.shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, paged_decode_attention_reference(*args), ATOL[dtype], f"graph replay lens={lens}")
