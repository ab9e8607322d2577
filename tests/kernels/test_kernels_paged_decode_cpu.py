"""The C++ CPU paged decode kernel vs naive float64 attention and the torch reference, on NaN-poisoned caches."""

import math
import os
import platform
import shutil

import pytest
import torch
from kernel_testing import ATOL, PagedKV, assert_close, bad_decode_overrides, default_scale, naive_attention

from kernels.paged_decode import paged_decode_attention_reference
from kernels.cpu_library import CpuKernelUnavailable
from kernels.paged_decode_cpu import CpuPagedDecode

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")

NUM_KV_HEADS = 2
CPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


X86 = platform.machine() in ("x86_64", "AMD64", "i686")


@pytest.fixture(scope="module", params=["native", "portable"])
def kernel(request, tmp_path_factory):
    """The kernel as the engine builds it, and (x86) built without AVX-512, AVX2 and F16C: the 16-byte vectors and
    the software float16 conversions, which CPUs without those features run."""
    if request.param == "portable":
        if not X86:
            pytest.skip("the portable build is what non-x86 machines run already")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(CpuPagedDecode, "FLAGS", CpuPagedDecode.FLAGS + ["-mno-avx512f", "-mno-avx2", "-mno-f16c"])
            return CpuPagedDecode(tmp_path_factory.mktemp("cpu_kernels_portable"))
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


@pytest.mark.parametrize("head_dim, group", [(64, 3), (128, 2), (40, 3)])
def test_float32_queries_over_bfloat16_caches(kernel, head_dim, group):
    """The bfloat16 C++ step's attention: float32 queries and output over bfloat16 caches, against float64 attention
    over the same (bf16) cache values and float32 queries, at float32's tolerance (nothing is rounded to bf16)."""
    lens = [1, 37, 300, 0]
    kv, _, context_lens = _setup(lens, 16, group, head_dim, torch.bfloat16, seed=9)
    query = torch.randn(len(lens), NUM_KV_HEADS * group, head_dim, generator=torch.Generator().manual_seed(10))
    scale = default_scale(head_dim)
    got = kernel(query, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, scale)
    assert got.dtype == torch.float32 and torch.equal(got[3], torch.zeros_like(got[3]))
    assert_close(got, _naive(kv, query, lens, scale), ATOL[torch.float32], "float32 query vs float64")
    rounded = kernel(query.bfloat16(), kv.k_cache, kv.v_cache, kv.block_tables, context_lens, scale)
    assert not torch.equal(got, rounded.float()), "the query was not rounded to bf16 on the way"
    with pytest.raises(ValueError, match="out must be float32"):
        kernel(query, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, scale, out=query.bfloat16())


@pytest.mark.parametrize("head_dim", [64, 24])
def test_cpu_decode_large_score_range_and_strided_tensors(kernel, head_dim):
    """Scores spanning hundreds of units (most probabilities underflow to 0, as with attention sinks), a query
    that is a view into a wider QKV tensor, a V cache laid out unlike the K cache, a preallocated `out` larger
    than the batch with a head stride other than head_dim, and head_dim 24 (not a multiple of the vector width)."""
    group, scale = 2, 3.0
    lens = [9, 40, 200]
    kv, _, context_lens = _setup(lens, 16, group, head_dim, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(len(lens), NUM_KV_HEADS * group + 7, head_dim, generator=gen) * 4
    query = qkv[:, 3 : 3 + NUM_KV_HEADS * group]
    wide = torch.full(kv.v_cache.shape[:2] + (NUM_KV_HEADS + 1, head_dim + 8), float("nan"))
    v_cache = wide[:, :, 1:, 8:]  # other block, token and head strides than k_cache
    v_cache.copy_(kv.v_cache)
    big_out = torch.full((8, query.shape[1], head_dim + 5), float("nan"))
    out = big_out[: len(lens), :, :head_dim]
    got = kernel(query, kv.k_cache, v_cache, kv.block_tables, context_lens, scale, out=out)
    assert got is out
    # A float32 score of magnitude S is rounded by up to 2 ulp(S) (the dot's sum and the scale), which scales its
    # softmax weight by exp(+-2 ulp(S)): near-tied scores of ~200 (ulp 1.5e-5) move the output by up to
    # 2 ulp(S) * max|v|, above the plain float32 tolerance.
    rows = [kv.sequence(b, n) for b, n in enumerate(lens)]  # the cache's live (not NaN-poisoned) K/V rows
    top_score = max((query[b].double() @ k.flatten(0, -2).T).abs().max().item() * scale for b, (k, _) in enumerate(rows))
    ulp = 2.0 ** (math.floor(math.log2(top_score)) - 23)
    tolerance = ATOL[torch.float32] + 2 * ulp * max(v.abs().max().item() for _, v in rows)
    assert_close(out, _naive(kv, query, lens, scale), tolerance, "cpu kernel vs float64")
    assert torch.isnan(big_out[len(lens):]).all(), "rows past the batch must not be written"
    assert torch.isnan(big_out[:, :, head_dim:]).all(), "columns past head_dim must not be written"


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_cpu_decode_rounds_once_to_nearest_even(kernel, dtype):
    """A zero query scores every token alike: the output is the mean of the V rows, computed in fp32 and
    rounded once. One token gives its V row bit for bit; two give (v0 + v1) / 2 rounded as torch rounds."""
    lens = [1, 2]
    kv, query, context_lens = _setup(lens, 16, 4, 64, dtype, seed=6)
    got = kernel(torch.zeros_like(query), kv.k_cache, kv.v_cache, kv.block_tables, context_lens, 1.0)
    rows = [torch.stack([kv.v_cache[int(kv.block_tables[b, 0]), t] for t in range(n)]) for b, n in enumerate(lens)]
    group = query.shape[1] // NUM_KV_HEADS
    expected = [r.float().mean(0).to(dtype).repeat_interleave(group, 0) for r in rows]
    assert torch.equal(got[0], expected[0]) and torch.equal(got[0], rows[0][0].repeat_interleave(group, 0))
    assert torch.equal(got[1], expected[1])


def test_cpu_decode_leaves_the_callers_float_mode_alone(kernel):
    """The kernel flushes denormals in its threads (FTZ/DAZ) and must restore the calling thread's mode."""
    tiny = float("5e-324")  # the smallest double: DAZ would read it as 0
    kv, query, context_lens = _setup([30], 16, 2, 64, torch.float32)
    kernel(query, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, 1.0)
    assert tiny * 1.5 > 0.0 and torch.tensor([1e-40]).mul(1.0).item() > 0.0


def test_cpu_decode_refuses_reads_outside_the_cache(kernel):
    """A length past the block table's columns or a block id outside the cache raises instead of reading
    memory that is not the cache; the next call works."""
    kv, query, context_lens = _setup([20, 9], 16, 2, 64, torch.float32)
    args = (query, kv.k_cache, kv.v_cache)
    width = kv.block_tables.shape[1]
    with pytest.raises(ValueError, match="row 0"):
        kernel(*args, kv.block_tables, torch.tensor([width * 16 + 1, 9], dtype=torch.int32), 1.0)
    for bad_block in (-1, kv.k_cache.shape[0]):
        tables = kv.block_tables.clone()
        tables[1, 0] = bad_block
        with pytest.raises(ValueError, match="row 1"):
            kernel(*args, tables, context_lens, 1.0)
    ok = kernel(*args, kv.block_tables, context_lens, 1.0)
    assert_close(ok, paged_decode_attention_reference(*args, kv.block_tables, context_lens, 1.0),
                 ATOL[torch.float32], "after refused calls")


def test_a_cache_with_block_size_0_is_refused_before_the_kernel_divides_by_it(kernel):
    kv, query, context_lens = _setup([5, 9], 16, 2, 16, torch.float32)
    empty = kv.k_cache[:, :0]
    with pytest.raises(ValueError, match=r"head_dim must be at least 1, got \(\d+, 0, 2, 16\)"):
        kernel(query, empty, empty.clone(), kv.block_tables, context_lens, 1.0)


def test_cpu_decode_rejects_bad_inputs(kernel):
    kv, query, context_lens = _setup([5, 9], 16, 2, 16, torch.float32)
    base = dict(query=query, k_cache=kv.k_cache, v_cache=kv.v_cache, block_tables=kv.block_tables,
                context_lens=context_lens, scale=1.0)
    bad = bad_decode_overrides(kv, query, context_lens) + [
        dict(query=torch.stack([query, query], -1)[..., 0]),  # head_dim not contiguous
    ]
    for override in bad:
        with pytest.raises(ValueError):
            kernel(**{**base, **override})
    assert_close(kernel(**base), paged_decode_attention_reference(**base), ATOL[torch.float32], "after errors")


def test_build_is_cached_and_failures_say_why(tmp_path, monkeypatch):
    first = CpuPagedDecode(tmp_path)
    built = first.path.stat().st_mtime_ns
    assert CpuPagedDecode(tmp_path).path == first.path and first.path.stat().st_mtime_ns == built
    # (the library's own folder: a sanitized build, scripts/test_sanitizers.sh, goes to a subfolder)
    assert [p.name for p in first.path.parent.iterdir()] == [first.path.name], "no temporary files left behind"

    umask = os.umask(0)
    os.umask(umask)
    assert first.path.stat().st_mode & 0o777 == 0o755 & ~umask, "mode as the umask allows, not mkstemp's 0600"
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(CpuKernelUnavailable, match="no C\\+\\+ compiler"):
        CpuPagedDecode(tmp_path / "other")
    monkeypatch.delenv("CXX")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CpuKernelUnavailable, match="building paged_decode_cpu.cpp"):
        CpuPagedDecode(tmp_path / "a-file" / "kernels")  # the build folder cannot be made
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(CpuPagedDecode, "SOURCE", broken)
    with pytest.raises(CpuKernelUnavailable, match="compiling broken.cpp failed"):
        CpuPagedDecode(tmp_path / "broken")
    assert not any((tmp_path / "broken").iterdir()), "a failed build leaves no library or temporary file"
