"""The C++ CPU paged decode kernel vs naive float64 attention and the torch reference, on NaN-poisoned caches."""

import os
import shutil

import pytest
import torch
from kernel_testing import ATOL, PagedKV, assert_close, default_scale, naive_attention

from kernels import paged_decode_cpu
from kernels.paged_decode import alloc_decode_workspace, paged_decode_attention_reference
from kernels.paged_decode_cpu import CpuKernelUnavailable, CpuPagedDecode

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")

NUM_KV_HEADS = 2
CPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return CpuPagedDecode(tmp_path_factory.mktemp("cpu_kernels"))


def _setup(lens, block_size, group, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = PagedKV(lens, block_size, NUM_KV_HEADS, head_dim, dtype, gen)
    kv.k_cache, kv.v_cache, kv.block_tables = kv.k_cache.cpu(), kv.v_cache.cpu(), kv.block_tables.cpu()
    query = torch.randn(len(lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    return kv, query, torch.tensor(lens, dtype=torch.int32)


def _naive(kv, query, lens, scale):
    rows = []
    for i, n in enumerate(lens):
        if n == 0:
            rows.append(torch.zeros(query.shape[1:], dtype=torch.float64))
            continue
        k, v = kv.sequence(i, n)
        rows.append(naive_attention(query[i : i + 1].cpu(), k.cpu(), v.cpu(), [n - 1], scale)[0])
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_decode_matches_naive_and_reference(kernel, block_size, group, dtype):
    head_dim = 64
    # 1 token, a partial block, a non-multiple, a long row, and an empty row (defined as zeros).
    lens = [1, block_size - 3, 37, 300, 0]
    kv, query, context_lens = _setup(lens, block_size, group, head_dim, dtype)
    scale = default_scale(head_dim)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, scale)
    got = kernel(*args)
    assert got.dtype == dtype and got.shape == query.shape
    assert torch.equal(got[4], torch.zeros_like(got[4]))
    assert_close(got, _naive(kv, query, lens, scale), ATOL[dtype], "cpu kernel vs float64")
    assert_close(got, paged_decode_attention_reference(*args), ATOL[dtype], "cpu kernel vs torch reference")


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("head_dim, group", [(128, 2), (64, 12), (40, 3)])
def test_cpu_decode_other_head_sizes_and_groups(kernel, head_dim, group, dtype):
    """head_dim 128 (the AVX-512 path's other size), a group beyond its 1-8, and a head_dim it does not take:
    the last two run the portable loop on every CPU."""
    lens = [5, 70]
    kv, query, context_lens = _setup(lens, 16, group, head_dim, dtype, seed=5)
    scale = default_scale(head_dim)
    got = kernel(query, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, scale)
    assert_close(got, _naive(kv, query, lens, scale), ATOL[dtype], "cpu kernel vs float64")


def test_cpu_decode_large_score_range_and_strided_query(kernel):
    """Scores spanning hundreds of units (most probabilities underflow to 0, as with attention sinks), a query
    that is a view into a wider QKV tensor, head_dim not a multiple of the vector width, and a preallocated
    `out` larger than the batch."""
    head_dim, group, scale = 24, 2, 3.0
    lens = [9, 40, 200]
    kv, _, context_lens = _setup(lens, 16, group, head_dim, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(len(lens), NUM_KV_HEADS * group + 7, head_dim, generator=gen) * 4
    query = qkv[:, 3 : 3 + NUM_KV_HEADS * group]
    big_out = torch.full((8, query.shape[1], head_dim), float("nan"))
    out = big_out[: len(lens)]
    got = kernel(query, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, scale, out=out)
    assert got is out
    assert_close(out, _naive(kv, query, lens, scale), ATOL[torch.float32], "cpu kernel vs float64")
    assert torch.isnan(big_out[len(lens):]).all(), "rows past the batch must not be written"


def test_cpu_decode_rejects_bad_inputs(kernel):
    kv, query, context_lens = _setup([5, 9], 16, 2, 16, torch.float32)
    base = dict(query=query, k_cache=kv.k_cache, v_cache=kv.v_cache, block_tables=kv.block_tables,
                context_lens=context_lens, scale=1.0)
    bad = [
        dict(block_tables=kv.block_tables.long()),
        dict(context_lens=context_lens.long()),
        dict(context_lens=context_lens[:1]),
        dict(block_tables=torch.stack([kv.block_tables, kv.block_tables], 2)[..., 0]),  # strided rows
        dict(query=query[:, :3]),  # 3 q heads, 2 kv heads
        dict(query=query[..., :8]),
        dict(query=query.half()),
        dict(query=torch.stack([query, query], -1)[..., 0]),  # head_dim not contiguous
        dict(out=torch.empty(2, 4, 8)),
        dict(num_splits=3, workspace=alloc_decode_workspace(2, 4, 16, 2, "cpu")),
    ]
    for override in bad:
        with pytest.raises(ValueError):
            kernel(**{**base, **override})
    assert_close(kernel(**base), paged_decode_attention_reference(**base), ATOL[torch.float32], "after errors")


def test_build_is_cached_and_failures_say_why(tmp_path, monkeypatch):
    first = CpuPagedDecode(tmp_path)
    built = first.path.stat().st_mtime_ns
    assert CpuPagedDecode(tmp_path).path == first.path and first.path.stat().st_mtime_ns == built
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name], "no temporary files left behind"

    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(CpuKernelUnavailable, match="no C\\+\\+ compiler"):
        CpuPagedDecode(tmp_path / "other")
    monkeypatch.delenv("CXX")
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(paged_decode_cpu, "SOURCE", broken)
    with pytest.raises(CpuKernelUnavailable, match="compiling broken.cpp failed"):
        CpuPagedDecode(tmp_path / "broken")
    assert not any((tmp_path / "broken").iterdir()), "a failed build leaves no library or temporary file"
