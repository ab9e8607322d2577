"""The float32 CPU engine's per-layer elementwise work in C++ (``cpu_ops.cpp``), one call each: RMSNorm, rotary
embedding of q/k fused with writing the step's K/V into the paged cache (float32, or bfloat16 rounded to nearest
even), and SiLU(gate) * up. Built on first use
(``kernels/cpu_library.py``) and called through ctypes.

Why: in torch these are 5-10 ops each (RMSNorm: square, mean, add, rsqrt, two multiplies; RoPE: slices, negation,
concatenation, two multiplies, an add; the cache write: a mask, a selection, a division, a remainder and two
indexed stores), each paying torch's dispatch overhead on tensors of a few thousand floats at decode batch sizes.
The references they replace, and match, are the torch code in ``omni_backend/engine/models/`` and
``kernels/store_kv.store_kv_reference``: RoPE bit for bit, RMSNorm up to the order of its sum of squares, SiLU up
to its exp (``cpu_math.h``, about 2e-7 relative).

All tensors are float32 (int64 positions and slots; the caches float32 or bfloat16) on the CPU, rows with unit
stride in their last dimension; the work runs on the calling thread's OpenMP team with the GIL released.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu_library import CpuLibrary, check_cpu_tensor, check_float32_rows

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
          "-shared", "-fPIC", "-std=c++17"]
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
ROPE_STORE_KV = {torch.float32: "rope_store_kv_f32", torch.bfloat16: "rope_store_kv_f32_bf16"}  # by cache dtype
_SIGNATURES = {
    "rms_norm_f32": ([_PTR, _I64, _I64, _I64, _PTR, ctypes.c_float, _PTR, _I64], None),
    "rope_store_kv_f32": ([_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64,
                           _I64], _I64),
    "rope_store_kv_f32_bf16": ([_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64,
                                _I64], _I64),
    "silu_mul_f32": ([_PTR, _I64, _I64, _I64, _PTR, _I64], None),
}


class CpuOps(CpuLibrary):
    """The built library (`kernels.cpu_library.CpuLibrary`: built in ``build_dir`` on first use).

    Raises:
        kernels.cpu_library.CpuKernelUnavailable: the library cannot be built or loaded here (the message says why).
    """

    SOURCE = Path(__file__).with_name("cpu_ops.cpp")
    FLAGS = _FLAGS
    SIGNATURES = _SIGNATURES

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * x / sqrt(mean(x^2, -1) + eps)`` for x ``[M, H]``, weight ``[H]``: a new ``[M, H]`` tensor
        (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019; HF LlamaRMSNorm in float32).

        Raises:
            ValueError: a tensor outside the module's contract or mismatched sizes.
        """
        check_float32_rows("x", x)
        m, h = x.shape
        check_cpu_tensor("weight", weight, torch.float32, (h,))
        out = torch.empty((m, h), dtype=torch.float32)
        self._fn["rms_norm_f32"](x.data_ptr(), m, h, x.stride(0), weight.data_ptr(), eps, out.data_ptr(), h)
        return out

    def rope_store_kv(self, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> None:
        """Rotate the query and key heads of ``qkv [T, (Hq + 2 Hkv) * D]`` in place by ``cos/sin [P, D]`` at
        ``positions [T]`` (half-split pairing, as HF's rotate_half; Su et al., "RoFormer", 2021), then write each
        row's key and value heads to ``k_cache/v_cache [num_blocks, block_size, Hkv, D]`` (contiguous; float32, or
        bfloat16: rounded to nearest even) at ``slot_mapping [T]`` (-1: padding, not stored), as
        ``kernels.store_kv.store_kv_reference``.

        Raises:
            ValueError: a head count below 1, a tensor outside the contract, or a row whose position is outside
                [0, P) or whose slot is beyond the cache (the first such row is named; it is left as it was, every
                other row is done).
        """
        if num_q_heads < 1 or num_kv_heads < 1:
            # a negative count can still match qkv's width (-2 + 2 x 2 heads) and the kernel would then read
            # before qkv's first byte
            raise ValueError(f"num_q_heads and num_kv_heads must be at least 1, got {num_q_heads}, {num_kv_heads}")
        check_float32_rows("qkv", qkv)
        t = qkv.shape[0]
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        if kv_heads != num_kv_heads or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(f"qkv [{t}, {qkv.shape[1]}] does not hold {num_q_heads} + 2 x {num_kv_heads} heads of "
                             f"{head_dim} (cache {tuple(k_cache.shape)})")
        cache_dtype = torch.bfloat16 if k_cache.dtype == torch.bfloat16 else torch.float32
        check_cpu_tensor("k_cache", k_cache, cache_dtype, tuple(k_cache.shape))
        check_cpu_tensor("v_cache", v_cache, cache_dtype, tuple(k_cache.shape))
        if head_dim % 2:
            raise ValueError(f"rotary embedding pairs the halves of a head: head_dim must be even, got {head_dim}")
        check_cpu_tensor("cos", cos, torch.float32, (cos.shape[0] if cos.dim() == 2 else -1, head_dim))
        check_cpu_tensor("sin", sin, torch.float32, tuple(cos.shape))
        check_cpu_tensor("positions", positions, torch.int64, (t,))
        check_cpu_tensor("slot_mapping", slot_mapping, torch.int64, (t,))
        bad = self._fn[ROPE_STORE_KV[cache_dtype]](
            qkv.data_ptr(), t, qkv.stride(0), num_q_heads, num_kv_heads, head_dim, positions.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), cos.shape[0], slot_mapping.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), num_blocks, block_size)
        if bad >= 0:
            raise ValueError(f"row {bad}: position {int(positions[bad])} outside [0, {cos.shape[0]}) or slot "
                             f"{int(slot_mapping[bad])} beyond the cache's {num_blocks * block_size}")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up [M, 2 I]`` (gate columns first): a new ``[M, I]`` tensor (SwiGLU,
        Shazeer, "GLU Variants Improve Transformer", 2020).

        Raises:
            ValueError: a tensor outside the contract or an odd width.
        """
        check_float32_rows("gate_up", gate_up)
        m, width = gate_up.shape
        if width % 2:
            raise ValueError(f"gate_up must have an even width, got {width}")
        out = torch.empty((m, width // 2), dtype=torch.float32)
        self._fn["silu_mul_f32"](gate_up.data_ptr(), m, width // 2, gate_up.stride(0), out.data_ptr(), width // 2)
        return out

