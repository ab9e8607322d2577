"""Paged prefill attention for CPUs: a C++ kernel (``paged_prefill_cpu.cpp``, which describes its blocking) for the
prefill rows of a C++ CPU step, whose queries are float32 over float32 or bfloat16 caches. Built on first use with
the machine's C++ compiler and called through ctypes.

Why: the torch reference (:func:`kernels.paged_prefill.paged_prefill_attention_reference`: gather, widen, torch's
SDPA per sequence) ran SmolLM2's causal prefill attention at 33 GFLOP/s for 320-token prompts and 55 GFLOP/s for
1,000 on the AMD EPYC (Zen 4), 22-37 % of a bfloat16 prefill there; this kernel's GEMM-like blocks (no horizontal
sum per score) do the same work faster (docs/benchmarks.md has the measurements).

Contract: :func:`kernels.paged_prefill.paged_prefill_attention`'s (query ``[T, Hq, D]``, caches ``[num_blocks,
block_size, Hkv, D]``, int32 ``block_tables [S, max_blocks]``, ``query_start_loc [S+1]``, ``context_lens [S]``;
query ``i`` of a chunk sits at position ``context_len - q_len + i`` and sees keys up to it) with a float32 query and
float32 output over float32 or bfloat16 caches on the CPU. Precision: float32 throughout, as the reference, but
over bfloat16 caches where the CPU's vdpbf16ps is not outrun by its FMAs (`CpuPagedPrefill.bf16_pairs`, measured
once per process as the linear kernels do: the AMD EPYC, not the Intel Xeons measured): there the queries and the
softmax weights are rounded to bfloat16 for vdpbf16ps (as vLLM's and FlashAttention's kernels hold them in a
bfloat16 model), float32 accumulation and softmax; the tests bound what that rounding adds.
:meth:`CpuPagedPrefill.supports` says which shapes the kernel takes (head_dim a multiple of 4 SIMD vectors, at
most 12 query heads per KV head); the backend sends others to the reference.

Build: as :mod:`kernels.paged_decode_cpu` (``-O3 -march=native -fopenmp``, ``kernels/cpu_library.py``).
"""

from __future__ import annotations

import ctypes
import itertools
from pathlib import Path

import torch

from kernels.cpu_library import CpuLibrary
from kernels.paged_prefill import _check

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math",
          "-shared", "-fPIC", "-std=c++17"]
_SYMBOLS = {torch.float32: "paged_prefill_f32", torch.bfloat16: "paged_prefill_f32_bf16"}
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGTYPES = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR,
             _I64, _PTR, ctypes.c_float]


class CpuPagedPrefill(CpuLibrary):
    """The built kernel (`kernels.cpu_library.CpuLibrary`: built in ``build_dir`` on first use); see the module
    docstring for the contract.

    Attributes:
        head_dim_multiple: head_dim must be a multiple of it (4 SIMD vectors: 64 with AVX-512, 32 AVX2, 16 else).
        max_group: the most query heads per KV head it takes (12).
        bf16_pairs: bfloat16 caches run through vdpbf16ps with bfloat16-rounded queries and weights (see the
            module docstring); False: float32 FMAs over the widened values.

    Raises:
        kernels.cpu_library.CpuKernelUnavailable: the kernel cannot be built or loaded here (the message says why).
    """

    SOURCE = Path(__file__).with_name("paged_prefill_cpu.cpp")
    FLAGS = _FLAGS
    SIGNATURES = {**{symbol: (_ARGTYPES, ctypes.c_int64) for symbol in _SYMBOLS.values()},
                  "paged_prefill_head_dim_multiple": ([], ctypes.c_int64),
                  "paged_prefill_bf16_pairs": ([], ctypes.c_int64),
                  "paged_prefill_max_group": ([], ctypes.c_int64)}

    def __init__(self, build_dir):
        super().__init__(build_dir)
        self.head_dim_multiple = int(self._fn["paged_prefill_head_dim_multiple"]())
        self.max_group = int(self._fn["paged_prefill_max_group"]())
        self.bf16_pairs = bool(self._fn["paged_prefill_bf16_pairs"]())

    def supports(self, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether the kernel takes this query ([T, Hq, D]) over this cache ([num_blocks, block_size, Hkv, D]): a
        float32 query, a float32 or bfloat16 cache, D a multiple of `head_dim_multiple` and Hq / Hkv at most
        `max_group`."""
        if k_cache.dim() != 4 or query.dim() != 3 or k_cache.shape[2] == 0:
            return False
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        return (query.dtype == torch.float32 and k_cache.dtype in _SYMBOLS and head_dim % self.head_dim_multiple == 0
                and query.shape[1] % num_kv_heads == 0
                and query.shape[1] // num_kv_heads <= self.max_group)

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of ``query`` (float32 ``[T, Hq, D]``) over each chunk's context -> float32 ``[T, Hq, D]``.

        Runs on the calling thread's OpenMP team (over sequences x KV heads), with the GIL released (ctypes). Every
        block a sequence would read is checked first: nothing is read out of bounds.

        Raises:
            ValueError: the inputs break the contract (as the reference's checks, and query_start_loc past the
                query's tokens or falling), a shape the kernel does not take
                (`supports`), a tensor not on the CPU or not contiguous in head_dim, or a sequence with more new
                tokens than context, more blocks than its table has columns, or a block outside the cache.
        """
        _check(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, float32_query=True)
        if not self.supports(query, k_cache) or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"the CPU prefill kernel takes a float32 query over float32 or bfloat16 caches with "
                             f"head_dim a multiple of {self.head_dim_multiple} and at most {self.max_group} query "
                             f"heads per KV head, got {query.dtype} {tuple(query.shape)} over {k_cache.dtype} "
                             f"{tuple(k_cache.shape)}")
        for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.device.type != "cpu":
                raise ValueError(f"{name} is on {t.device}; this kernel runs on CPU tensors")
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
        num_seqs = context_lens.shape[0]
        starts = query_start_loc.tolist()
        if starts[0] < 0 or starts[-1] > query.shape[0] or any(b < a for a, b in itertools.pairwise(starts)):
            raise ValueError(f"query_start_loc must rise from >= 0 to at most {query.shape[0]} (the query's tokens), "
                             f"got {starts}")
        out = torch.empty_like(query)
        if query.shape[0] == 0 or num_seqs == 0:
            return out
        block_tables, query_start_loc, context_lens = (t.contiguous() for t in (block_tables, query_start_loc,
                                                                                 context_lens))
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        strides = [(ctypes.c_int64 * 3)(*t.stride()[:3]) for t in (query, k_cache, v_cache, out)]
        bad_seq = self._fn[_SYMBOLS[k_cache.dtype]](
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            query_start_loc.data_ptr(), context_lens.data_ptr(), out.data_ptr(), num_seqs, query.shape[1],
            num_kv_heads, head_dim, block_size, num_blocks, block_tables.shape[1], strides[0], strides[1],
            strides[2], block_tables.stride(0), strides[3], scale)
        if bad_seq >= 0:
            why = self._why_refused(bad_seq, starts, context_lens, block_tables, block_size, num_blocks)
            raise ValueError(f"sequence {bad_seq}: {why}")
        return out

    @staticmethod
    def _why_refused(seq: int, starts: list[int], context_lens: torch.Tensor, block_tables: torch.Tensor,
                     block_size: int, num_blocks: int) -> str:
        """Which of the kernel's checks sequence `seq` failed, in words."""
        q_len, ctx = starts[seq + 1] - starts[seq], int(context_lens[seq])
        if q_len > ctx:
            return f"{q_len} new tokens but context_lens is {ctx}"
        blocks = -(-ctx // block_size)
        if blocks > block_tables.shape[1]:
            return f"context length {ctx} needs {blocks} blocks, the block table has {block_tables.shape[1]} columns"
        return f"its block table names a block outside [0, {num_blocks}) within its {blocks} blocks"
