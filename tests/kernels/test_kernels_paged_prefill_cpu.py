"""The C++ CPU paged prefill kernel vs naive float64 causal attention and the torch reference, on NaN-poisoned
caches, for every vector width it is built with."""

import os
import platform
import shutil

import pytest
import torch
from kernel_testing import ATOL, PagedKV, assert_close, default_scale, naive_attention

from kernels.cpu_library import cpu_features
from kernels.paged_prefill import paged_prefill_attention_reference
from kernels.paged_prefill_cpu import CpuPagedPrefill
from omni_backend.engine.attention.cpu_backend import CpuAttention
from omni_backend.engine.attention.interface import AttentionMetadata

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")

X86 = platform.machine() in ("x86_64", "AMD64", "i686")
HAS_BF16 = X86 and "avx512_bf16" in cpu_features()
CACHE_DTYPES = [torch.float32, torch.bfloat16]
# float32 throughout, as the reference: within float32's tolerance of float64 (kernel_testing.ATOL)
TOL = ATOL[torch.float32]
BUILDS = {  # extra compiler flags: the vector widths other CPUs run, and both ways to multiply bfloat16 K/V
    "native": [], "avx2": ["-mno-avx512f"], "portable": ["-mno-avx512f", "-mno-avx2"],
    "bf16-pairs": ["-DOMNI_BF16_KERNEL=1"], "bf16-fma": ["-DOMNI_BF16_KERNEL=3"],
}


@pytest.fixture(scope="module", params=list(BUILDS))
def kernel(request, tmp_path_factory):
    """The kernel as the engine builds it; (x86) built without AVX-512 (8-float vectors) and without AVX2 too
    (4-float vectors), each with its own head_dim multiple (4 vectors); (AVX512-BF16) with bfloat16 caches on the
    vdpbf16ps pair path and on the float32 FMAs, whichever the native build measured faster."""
    if request.param in ("avx2", "portable") and not X86:
        pytest.skip("the portable build is what non-x86 machines run already")
    if request.param.startswith("bf16") and not HAS_BF16:
        pytest.skip("this CPU has no AVX512-BF16")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CpuPagedPrefill, "FLAGS", CpuPagedPrefill.FLAGS + BUILDS[request.param])
        built = CpuPagedPrefill(tmp_path_factory.mktemp(f"cpu_prefill_{request.param}"))
    assert built.bf16_pairs == (request.param == "bf16-pairs") or request.param == "native"
    return built


def _assert_matches_float64(got, pairs, kv, query, q_lens, ctx_lens, scale, what):
    """`got` against float64 causal attention over the values the cache holds. float32 path: within float32's TOL.
    Pair path (`pairs`: bfloat16 caches through vdpbf16ps): against float64 attention of the queries rounded as the
    kernel rounds them (bf16(float32(q * scale))), within TOL plus what rounding the softmax weights to bfloat16
    can add: each weight w_t becomes w_t (1 + rho_t), |rho_t| <= 2^-8 (bfloat16's unit roundoff: 8 significant
    bits), over the unrounded sum, so an output element moves by at most 2^-8 sum_t w_t |v_td|, which is the same
    attention over |v|."""
    wide = PagedKV.__new__(PagedKV)
    wide.__dict__.update(kv.__dict__, k_cache=kv.k_cache.float(), v_cache=kv.v_cache.float())
    if not pairs:
        assert_close(got, _naive(wide, query, q_lens, ctx_lens, scale), TOL, what)
        return
    rounded = (query.float() * scale).bfloat16().double()
    want = _naive(wide, rounded, q_lens, ctx_lens, 1.0)
    wide.v_cache = wide.v_cache.abs()
    bound = 2.0**-8 * _naive(wide, rounded, q_lens, ctx_lens, 1.0) + TOL
    excess = ((got.double() - want).abs() - bound).max().item()
    assert not torch.isnan(got).any() and excess <= 0, f"{what}: over the bound by {excess:.3g}"


def _setup(q_lens, ctx_lens, block_size, num_kv_heads, group, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = PagedKV(ctx_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen)
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return kv, query, starts, torch.tensor(ctx_lens, dtype=torch.int32)


def _naive(kv, query, q_lens, ctx_lens, scale):
    out, t = torch.zeros_like(query, dtype=torch.float64), 0
    for i, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens)):
        k, v = kv.sequence(i, ctx)
        out[t : t + q_len] = naive_attention(query[t : t + q_len], k, v, list(range(ctx - q_len, ctx)), scale)
        t += q_len
    return out


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("num_kv_heads, group", [(3, 3), (2, 1), (2, 4), (1, 5), (1, 8), (1, 12)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_prefill_matches_naive_and_reference(kernel, block_size, num_kv_heads, group, dtype):
    """Whole prompts, chunks over a cached prefix, a sequence with no new tokens, lengths that are no multiple of
    the block, the vector or the tokens a block of rows holds (12 / group), and one of 1 token."""
    pairs = [(37, 37), (9, 70), (0, 12), (1, 1), (23, 24), (130, 130)]
    q_lens, ctx_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    head_dim = kernel.head_dim_multiple
    kv, query, starts, context_lens = _setup(q_lens, ctx_lens, block_size, num_kv_heads, group, head_dim, dtype)
    scale = default_scale(head_dim)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, starts, context_lens, scale)
    assert kernel.supports(query, kv.k_cache)
    got = kernel(*args)
    assert got.dtype == torch.float32 and got.shape == query.shape
    pairs = dtype == torch.bfloat16 and kernel.bf16_pairs
    _assert_matches_float64(got, pairs, kv, query, q_lens, ctx_lens, scale, "cpu prefill vs float64")
    if not pairs:
        assert_close(got, paged_prefill_attention_reference(*args), TOL, "cpu prefill vs torch reference")


@pytest.mark.parametrize("head_dim", [128, 256])
def test_prefill_wider_heads_and_strided_query(kernel, head_dim):
    """A head_dim of several passes of P V, and a query that is a view of a wider projection output (as the CPU
    step's q inside its qkv rows)."""
    if head_dim % kernel.head_dim_multiple:
        pytest.skip(f"head_dim {head_dim} is not a multiple of this build's {kernel.head_dim_multiple}")
    q_lens, ctx_lens = [20, 6], [20, 33]
    kv, query, starts, context_lens = _setup(q_lens, ctx_lens, 16, 2, 2, head_dim, torch.bfloat16, seed=3)
    qkv = torch.cat([query.flatten(1), torch.randn(query.shape[0], 2 * 2 * head_dim)], 1)
    strided = qkv[:, : query[0].numel()].unflatten(1, query.shape[1:])
    assert not strided.is_contiguous()
    scale = default_scale(head_dim)
    got = kernel(strided, kv.k_cache, kv.v_cache, kv.block_tables, starts, context_lens, scale)
    _assert_matches_float64(got, kernel.bf16_pairs, kv, query, q_lens, ctx_lens, scale, "strided query")


def test_prefill_rows_do_not_depend_on_the_other_sequences(kernel):
    """A sequence's rows are the same bits alone and beside others (batch invariance: each sequence and KV head is
    one work item, its arithmetic independent of the rest of the call)."""
    q_lens, ctx_lens = [15, 40, 3], [15, 52, 3]
    head_dim = kernel.head_dim_multiple
    kv, query, starts, context_lens = _setup(q_lens, ctx_lens, 16, 3, 3, head_dim, torch.bfloat16, seed=7)
    together = kernel(query, kv.k_cache, kv.v_cache, kv.block_tables, starts, context_lens, 0.125)
    alone = kernel(query[15:55], kv.k_cache, kv.v_cache, kv.block_tables[1:2], torch.tensor([0, 40], dtype=torch.int32),
                   context_lens[1:2], 0.125)
    assert torch.equal(together[15:55], alone)


def test_prefill_large_scores_stay_finite(kernel):
    """Scores far apart (scale 30): the max is subtracted before exp, so no row overflows; as the reference."""
    head_dim = kernel.head_dim_multiple
    kv, query, starts, context_lens = _setup([33], [33], 16, 1, 3, head_dim, torch.float32, seed=11)
    got = kernel(query, kv.k_cache, kv.v_cache, kv.block_tables, starts, context_lens, 30.0)
    assert torch.isfinite(got).all()
    assert_close(got, paged_prefill_attention_reference(query, kv.k_cache, kv.v_cache, kv.block_tables, starts,
                                                        context_lens, 30.0), 1e-4, "large scores")


def test_prefill_refuses_what_it_does_not_take_and_reads_outside_the_cache(kernel):
    """Shapes it does not take, more new tokens than context, a length past the block table, a block outside the
    cache and query_start_loc past the query raise ValueError; the next call works."""
    head_dim = kernel.head_dim_multiple
    kv, query, starts, context_lens = _setup([5, 9], [5, 20], 16, 2, 2, head_dim, torch.float32)
    args = (query, kv.k_cache, kv.v_cache)
    assert not kernel.supports(query.bfloat16(), kv.k_cache.bfloat16())
    assert not kernel.supports(query[..., :8], kv.k_cache[..., :8])
    assert not kernel.supports(torch.randn(3, 26, head_dim), kv.k_cache)  # 13 query heads per KV head
    with pytest.raises(ValueError, match="takes a float32 query"):
        kernel(query.bfloat16(), kv.k_cache.bfloat16(), kv.v_cache.bfloat16(), kv.block_tables, starts,
               context_lens, 1.0)
    assert not kernel.supports(query, kv.k_cache[0])  # a cache that is not [blocks, block_size, Hkv, D]
    with pytest.raises(ValueError, match="sequence 1: 9 new tokens but context_lens is 8"):
        kernel(*args, kv.block_tables, starts, torch.tensor([5, 8], dtype=torch.int32), 1.0)
    width = kv.block_tables.shape[1]
    with pytest.raises(ValueError, match=f"sequence 0: context length {width * 16 + 1} needs {width + 1} blocks, "
                                         f"the block table has {width} columns"):
        kernel(*args, kv.block_tables, starts, torch.tensor([width * 16 + 1, 20], dtype=torch.int32), 1.0)
    for bad_block in (-1, kv.k_cache.shape[0]):
        tables = kv.block_tables.clone()
        tables[1, 0] = bad_block
        with pytest.raises(ValueError, match=r"sequence 1: its block table names a block outside \[0, "):
            kernel(*args, tables, starts, context_lens, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        kernel(*args, kv.block_tables, torch.tensor([0, 5, 15], dtype=torch.int32), context_lens, 1.0)
    ok = kernel(*args, kv.block_tables, starts, context_lens, 1.0)
    assert_close(ok, paged_prefill_attention_reference(*args, kv.block_tables, starts, context_lens, 1.0), TOL,
                 "after refused calls")


def test_cpu_backend_prefills_float32_queries_with_the_kernel(tmp_path, monkeypatch):
    """The cpu attention backend runs float32 queries through the kernel and bfloat16 queries (torch modules over a
    bfloat16 cache) through the reference."""
    backend = CpuAttention(0.125, str(tmp_path))
    kv, query, starts, context_lens = _setup([6, 4], [6, 30], 16, 3, 3, 64, torch.bfloat16, seed=2)
    meta = AttentionMetadata(slot_mapping=torch.zeros(10, dtype=torch.int64), num_prefill_tokens=10,
                             prefill_query_start_loc=starts, prefill_context_lens=context_lens,
                             prefill_block_tables=kv.block_tables, decode_block_tables=None, decode_context_lens=None)
    calls = []
    kernel_call = type(backend._prefill_kernel).__call__
    monkeypatch.setattr(type(backend._prefill_kernel), "__call__",
                        lambda self, *a: calls.append(a[0].dtype) or kernel_call(self, *a))
    got = backend.prefill(query, kv.k_cache, kv.v_cache, meta)
    assert calls == [torch.float32]
    _assert_matches_float64(got, backend._prefill_kernel.bf16_pairs, kv, query, [6, 4], [6, 30], 0.125,
                            "backend prefill")
    got16 = backend.prefill(query.bfloat16(), kv.k_cache, kv.v_cache, meta)
    assert calls == [torch.float32] and got16.dtype == torch.bfloat16
    assert torch.equal(got16, paged_prefill_attention_reference(query.bfloat16(), kv.k_cache, kv.v_cache,
                                                                kv.block_tables, starts, context_lens, 0.125))
