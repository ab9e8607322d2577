"""paged_decode_attention: Triton vs torch reference vs naive float64 attention on NaN-poisoned caches."""

import pytest
import torch
from kernel_testing import (ATOL, DEVICE, DTYPES, INTERPRET, PagedKV, assert_close, bad_decode_overrides, cdiv,
                            default_scale, naive_attention)

from kernels.paged_decode import (
    LOG2E,
    DecodeWorkspace,
    _launch_config,
    alloc_decode_workspace,
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)

NUM_KV_HEADS = 2
# (num_q_heads, num_kv_heads, head_dim) of the served models: SmolLM2-135M and an 8B Llama-3-class model.
PRODUCTION_HEADS = {"135m": (9, 3, 64), "8b": (32, 8, 128)}


def _setup(lens, block_size, group, head_dim, dtype, seed=0, num_kv_heads=NUM_KV_HEADS, table_width=None):
    gen = torch.Generator().manual_seed(seed)
    kv = PagedKV(lens, block_size, num_kv_heads, head_dim, dtype, gen, table_width=table_width)
    query = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return kv, query, context_lens


def _kv_tile(head_dim, dtype):
    """The kernel's KV tile (BLOCK_N) for this head_dim and dtype."""
    return _launch_config(head_dim, dtype)[1]


def _split_ranges(context_len, num_splits, block_n):
    """Token range [start, end) of each split, written from the rule in kernels/paged_decode.py's docstring:
    split s takes KV tiles [s * T // num_splits, (s + 1) * T // num_splits) of T = ceil(context_len / block_n)."""
    tiles = cdiv(context_len, block_n)
    return [(s * tiles // num_splits * block_n, min((s + 1) * tiles // num_splits * block_n, context_len))
            for s in range(num_splits)]


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
    assert all(end > start for start, end in _split_ranges(150, 3, _kv_tile(head_dim, dtype))), \
        "test must cover a sequence that spans three splits"

    ref = paged_decode_attention_reference(*args)
    assert ref.dtype == dtype and ref.shape == query.shape
    assert_close(ref, _naive(kv, query, lens, default_scale(head_dim)), ATOL[dtype], "reference vs float64")
    for num_splits in (1, 3, None):
        got = paged_decode_attention(*args, num_splits=num_splits)
        assert got.dtype == dtype and got.shape == query.shape
        assert_close(got, ref, ATOL[dtype], f"kernel num_splits={num_splits}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_table_wider_than_context(dtype):
    """An engine-like block table (80 columns, 1280 tokens of capacity) far wider than the contexts: the columns
    past each context hold garbage block ids (0: all-NaN, -1, past the cache) that must never be read."""
    head_dim, group, block_size = 32, 3, 16
    lens = [37, 150, 1, 0]
    kv, query, context_lens = _setup(lens, block_size, group, head_dim, dtype, seed=8, table_width=80)
    assert kv.block_tables.shape[1] - cdiv(150, block_size) >= 64, "at least 64 garbage columns past the context"
    scale = default_scale(head_dim)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, scale)
    ref = paged_decode_attention_reference(*args)
    assert_close(ref, _naive(kv, query, lens, scale), ATOL[dtype], "reference vs float64")
    for num_splits in (2, 3, 4):
        assert_close(paged_decode_attention(*args, num_splits=num_splits), ref, ATOL[dtype],
                     f"kernel num_splits={num_splits}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_partitions_follow_context_length(dtype):
    """Every split of a sequence with at least num_splits KV tiles gets work, though the table is 128 columns
    (2048 tokens) wide: partitions come from context_lens on the device, not from the table's capacity.

    Checked through the workspace, NaN-filled before the call: a split's sum_exp > 0 iff its token range under the
    documented rule is non-empty; empty splits hold m = -inf, l = 0 and leave partial_out untouched (the reduce
    must not read it: the output stays finite); in fp32 each split's m and l match float64 over exactly its range.
    """
    head_dim, group, block_size, num_splits = 32, 2, 16, 4
    tile = _kv_tile(head_dim, dtype)
    # At the threshold, one token past it (uneven shares: 1, 1, 1, 2 tiles), a partial last tile, shorter than
    # num_splits tiles, empty.
    lens = [num_splits * tile, num_splits * tile + 1, 150, 5, 0]
    kv, query, context_lens = _setup(lens, block_size, group, head_dim, dtype, seed=9, table_width=128)
    scale = default_scale(head_dim)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, scale)
    num_q_heads = query.shape[1]
    ws = alloc_decode_workspace(len(lens), num_q_heads, head_dim, num_splits, DEVICE)
    for t in ws:
        t.fill_(float("nan"))
    out = paged_decode_attention(*args, num_splits=num_splits, workspace=ws)
    assert_close(out, paged_decode_attention_reference(*args), ATOL[dtype], "kernel vs reference")

    for row in (0, 1):
        assert (ws.sum_exp[row] > 0).all(), f"row {row} (context {lens[row]}): a split got no tokens"
    for row, n in enumerate(lens):
        for split, (start, end) in enumerate(_split_ranges(n, num_splits, tile)):
            m, l_, acc = ws.max_logit[row, :, split], ws.sum_exp[row, :, split], ws.partial_out[row, :, split]
            where = f"row {row} (context {n}) split {split} [{start}, {end})"
            if end <= start:
                assert (m == float("-inf")).all() and (l_ == 0).all(), f"{where}: not an empty partial"
                assert torch.isnan(acc).all(), f"{where}: empty split wrote partial_out"
                continue
            assert (l_ > 0).all() and not torch.isnan(acc).any(), f"{where}: partial missing"
            if dtype != torch.float32:
                continue
            k, _ = kv.sequence(row, end)
            heads = torch.arange(num_q_heads, device=DEVICE)
            # log2-unit scores of this split's keys for every query head: [num_q_heads, end - start]
            s2 = torch.einsum("hd,nhd->hn", query[row].double(), k[start:, heads // group]) * scale * LOG2E
            want_m = s2.max(dim=1).values
            want_l = torch.exp2(s2 - want_m[:, None]).sum(dim=1)
            torch.testing.assert_close(m.double(), want_m, rtol=0, atol=1e-5, msg=f"{where}: max_logit")
            torch.testing.assert_close(l_.double(), want_l, rtol=1e-5, atol=0, msg=f"{where}: sum_exp")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", sorted(PRODUCTION_HEADS))
def test_decode_production_head_shapes(model, dtype):
    """The served models' heads (GQA group 3 at head_dim 64, group 4 at 128) over a table wider than the
    contexts, in one split (kernel 1 writes the output) and in four (at 100 tokens, every split busy with 32-token
    fp32 tiles, two of them empty with 64-token fp16 tiles). Contexts stay tiny for the interpreter."""
    num_q_heads, num_kv_heads, head_dim = PRODUCTION_HEADS[model]
    lens = [5, 100]
    kv, query, context_lens = _setup(lens, 16, num_q_heads // num_kv_heads, head_dim, dtype, seed=10,
                                     num_kv_heads=num_kv_heads, table_width=16)
    scale = default_scale(head_dim)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, scale)
    ref = paged_decode_attention_reference(*args)
    assert_close(ref, _naive(kv, query, lens, scale), ATOL[dtype], "reference vs float64")
    for num_splits in (1, 4):
        ws = alloc_decode_workspace(len(lens), num_q_heads, head_dim, num_splits, DEVICE)
        got = paged_decode_attention(*args, num_splits=num_splits, workspace=ws if num_splits > 1 else None)
        assert_close(got, ref, ATOL[dtype], f"{model} kernel num_splits={num_splits}")


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
    """out/workspace larger than the batch (CUDA-graph style) or sliced from a wider one, a strided query,
    head_dim not a power of 2."""
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
    # One workspace for every bucket, sized for the most splits and sliced to each bucket's count (strided views).
    wide = alloc_decode_workspace(8, query.shape[1], head_dim, 32, DEVICE)
    out.fill_(float("nan"))
    paged_decode_attention(*args, num_splits=num_splits, out=out,
                           workspace=DecodeWorkspace(*(t[:, :, :num_splits] for t in wide)))
    assert_close(out, ref, ATOL[torch.float32], "kernel with a workspace sliced to num_splits")
    ref_out = torch.empty_like(out)
    assert paged_decode_attention_reference(*args, out=ref_out) is ref_out


def test_default_num_splits_is_static_and_bounded():
    # The engine's buckets at max_model_len 8192 (block size 16: 512 columns, 8192 tokens of capacity).
    assert [default_num_splits(b, 8, 8192) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)] == [
        32, 32, 32, 16, 8, 4, 2, 1, 1]  # 8B: 8 KV heads
    assert [default_num_splits(b, 3, 8192) for b in (1, 8, 16, 24, 64, 256, 512)] == [
        32, 32, 22, 15, 6, 2, 1]  # 135M: 3 KV heads
    assert default_num_splits(1, 8, 32768) == 64  # 128 wanted, at most 64
    assert default_num_splits(1, 1, 100) == 1  # less than 256 tokens of capacity: never split
    for num_kv_heads in (1, 3, 8):
        for capacity in (100, 2048, 8192, 131072):
            splits = [default_num_splits(b, num_kv_heads, capacity) for b in range(1, 513)]
            assert splits == sorted(splits, reverse=True), "more rows never get more splits"
            for b, s in enumerate(splits, start=1):
                assert 1 <= s <= min(64, max(1, capacity // 256)), "bounded by 64 and 256 tokens a split"
                # About 1024 programs unless a bound stops it, with the fewest splits that get there.
                assert b * num_kv_heads * s >= 1024 or s == min(64, max(1, capacity // 256))
                assert s == 1 or b * num_kv_heads * (s - 1) < 1024


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
    """Capture once with static buffers and an engine-wide table, then change lengths/queries and replay (engine
    usage): the captured launch follows the new lengths, including its partitions (all four splits of a
    300-token row busy after replay though the graph was captured with that row at 5 tokens)."""
    head_dim, group, num_splits, dtype = 64, 4, 4, torch.float16
    lens_a, lens_b = [5, 100, 33, 0], [300, 1, 0, 77]
    kv, query, _ = _setup([max(a, b) for a, b in zip(lens_a, lens_b)], 16, group, head_dim, dtype, seed=7,
                          table_width=512)
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
    assert 300 >= num_splits * _kv_tile(head_dim, dtype) and (ws.sum_exp[0] > 0).all(), "a split of row 0 was idle"
