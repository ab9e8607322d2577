"""Paged decode attention for CPUs: a C++ kernel (``paged_decode_cpu.cpp``) that reads K/V in place from the
paged cache, built on first use with the machine's C++ compiler and called through ctypes.

Why: the torch reference (:func:`kernels.paged_decode.paged_decode_attention_reference`) must first copy every
sequence's K/V out of its blocks into a padded ``[B, Hkv, L, D]`` tensor, then run torch's attention with the
padding masked. On the engine's decode step (SmolLM2 bf16, batch 32, contexts 150-380) that copy plus
attention took 1.0-1.4 ms per layer, 45 % of the step; this kernel reads each cached token once, where it lies,
in 0.41-0.50 ms with the blocks in allocation order and about 0.7 ms with them scattered (AVX-512 path; see the
.cpp for its two paths and scripts/bench_cpu_decode.py).

Contract: the same as :func:`kernels.paged_decode.paged_decode_attention` (query ``[B, Hq, D]``, caches
``[num_blocks, block_size, Hkv, D]``, int32 block tables ``[B, max_blocks_per_seq]`` and ``context_lens [B]``;
output ``[B, Hq, D]`` in the query dtype; rows with ``context_lens == 0`` are zeros), with CPU tensors; a float32
query may also read bfloat16 caches (the bfloat16 C++ CPU step's activations are float32; output float32).
Precision: scores, softmax and the ``P @ V`` accumulation in fp32, the result rounded once to the cache dtype
(at least as precise as the Triton kernel, which rounds P to the input dtype).

Build: ``g++ -O3 -march=native -fopenmp`` into ``<build_dir>/paged_decode_cpu-<hash>.so`` on first use
(``kernels/cpu_library.py``: the hash, ``$CXX``, concurrent first uses). The SIMD path runs with the vectors the
build has (AVX-512, AVX2 or 16-byte; the .cpp says which shapes it takes); other shapes run the portable loop. The
library links libgomp by soname: with torch's own ``libgomp.so.1`` already loaded (torch 2.13's CPU wheel) it
joins that runtime and its thread count.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu_library import CpuLibrary
from kernels.paged_decode import _check

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math",
          "-shared", "-fPIC", "-std=c++17"]
_SYMBOLS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16", torch.float16: "paged_decode_f16"}
_F32_OVER_BF16 = "paged_decode_f32_bf16"  # float32 query and output, bfloat16 caches
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGTYPES = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64,
             _PTR, ctypes.c_float]


class CpuPagedDecode(CpuLibrary):
    """The built kernel (`kernels.cpu_library.CpuLibrary`: built in ``build_dir`` on first use). Call it as
    :func:`kernels.paged_decode.paged_decode_attention` on CPU tensors; its entry points are ``paged_decode_f32``,
    ``paged_decode_bf16`` and ``paged_decode_f16``, by cache dtype, and ``paged_decode_f32_bf16`` (float32 query and
    output over bfloat16 caches; the bfloat16 C++ step, ``kernels/cpu_decode_step.py``, calls it from C++ too).

    Raises:
        kernels.cpu_library.CpuKernelUnavailable: the kernel cannot be built or loaded here (the message says why).
    """

    SOURCE = Path(__file__).with_name("paged_decode_cpu.cpp")
    FLAGS = _FLAGS
    SIGNATURES = {symbol: (_ARGTYPES, ctypes.c_int64) for symbol in (*_SYMBOLS.values(), _F32_OVER_BF16)}

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        num_splits: int | None = None,
        out: torch.Tensor | None = None,
        workspace=None,
    ) -> torch.Tensor:
        """Attention of ``query [B, Hq, D]`` over each row's first ``context_lens[b]`` cached tokens.

        ``num_splits`` and ``workspace`` are validated (same contract as the Triton kernel) but unused: the
        kernel parallelises over sequences.

        Rows with ``context_lens <= 0`` are zeros. Unlike the Triton kernel (which cannot look without a device
        sync), this one checks every block it would read: a row whose length needs more blocks than the table has
        columns, or whose table names a block outside the cache, raises (nothing is read out of bounds). It runs
        on the calling thread's OpenMP team, with the GIL released (ctypes).

        Raises:
            ValueError: the inputs break the contract (as the Triton kernel's checks), a tensor is not on the
                CPU, a last dimension is not contiguous, or a row's length or block table is out of range.
        """
        mixed = query.dtype == torch.float32 and k_cache.dtype == torch.bfloat16
        if mixed and out is not None and (out.dtype != torch.float32 or out.shape != query.shape):
            raise ValueError(f"out must be float32 {tuple(query.shape)}, got {out.dtype} {tuple(out.shape)}")
        # a float32 query over bfloat16 caches is checked as a query of the caches' dtype (a copy of a decode
        # step's few rows)
        _check(query.to(k_cache.dtype) if mixed else query, k_cache, v_cache, block_tables, context_lens, num_splits,
               None if mixed else out, workspace)
        for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.device.type != "cpu":
                raise ValueError(f"{name} is on {t.device}; this kernel runs on CPU tensors")
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
        if out is None:
            out = torch.empty_like(query)
        elif out.stride(-1) != 1:
            raise ValueError(f"out must be contiguous in head_dim, got strides {out.stride()}")
        batch, num_q_heads, head_dim = query.shape
        if batch == 0:
            return out
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        strides = [(ctypes.c_int64 * 3)(*t.stride()[:3]) for t in (query, k_cache, v_cache, out)]
        bad_row = self._fn[_F32_OVER_BF16 if mixed else _SYMBOLS[query.dtype]](
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            context_lens.data_ptr(), out.data_ptr(), batch, num_q_heads, num_kv_heads, head_dim, block_size,
            num_blocks, block_tables.shape[1], strides[0], strides[1], strides[2], block_tables.stride(0),
            strides[3], scale)
        if bad_row >= 0:
            raise ValueError(f"row {bad_row}: context length {int(context_lens[bad_row])} needs blocks past the "
                             f"block table's {block_tables.shape[1]} columns, or its block table names a block "
                             f"outside [0, {num_blocks})")
        return out
