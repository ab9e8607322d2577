"""Paged decode attention for CPUs: a C++ kernel (``paged_decode_cpu.cpp``) that reads K/V in place from the
paged cache, built on first use with the machine's C++ compiler and called through ctypes.

Why: the torch reference (:func:`kernels.paged_decode.paged_decode_attention_reference`) must first copy every
sequence's K/V out of its blocks into a padded ``[B, Hkv, L, D]`` tensor, then run torch's attention with the
padding masked. On the engine's decode step (SmolLM2 bf16, batch 32, contexts 150-380) that copy plus
attention took 1.0-1.4 ms per layer, 45 % of the step; this kernel reads each cached token once, where it lies,
in 0.41-0.50 ms (AVX-512 path; see the .cpp for its two paths).

Contract: the same as :func:`kernels.paged_decode.paged_decode_attention` (query ``[B, Hq, D]``, caches
``[num_blocks, block_size, Hkv, D]``, int32 block tables ``[B, max_blocks_per_seq]`` and ``context_lens [B]``;
output ``[B, Hq, D]`` in the query dtype; rows with ``context_lens == 0`` are zeros), with CPU tensors.
Precision: scores, softmax and the ``P @ V`` accumulation in fp32, the result rounded once to the cache dtype
(at least as precise as the Triton kernel, which rounds P to the input dtype).

Build: ``g++ -O3 -march=native -fopenmp`` (``$CXX`` overrides the compiler) into
``<build_dir>/paged_decode_cpu-<hash>.so``, where the hash covers the source, the compiler's version and the
CPU's feature flags, so a cache folder shared between machines never loads code built for another CPU. The
build writes a temporary file and renames it, so concurrent first uses (several Triton stubs) are safe. The
library links libgomp by soname and so shares torch's OpenMP runtime and thread count.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.paged_decode import _check

SOURCE = Path(__file__).with_name("paged_decode_cpu.cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17"]
_SYMBOLS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16", torch.float16: "paged_decode_f16"}
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGTYPES = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR,
             ctypes.c_float]


class CpuKernelUnavailable(RuntimeError):
    """The C++ kernel cannot be built or loaded here (no compiler, or the compile failed); the message says why."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


class CpuPagedDecode:
    """The built kernel. Call it as :func:`kernels.paged_decode.paged_decode_attention` on CPU tensors.

    Args:
        build_dir: folder for the compiled library (created if missing).

    Raises:
        CpuKernelUnavailable: no C++ compiler, the compile failed, or the library does not load.
    """

    def __init__(self, build_dir: str | os.PathLike):
        compiler = shutil.which(os.environ.get("CXX", "g++"))
        if compiler is None:
            raise CpuKernelUnavailable(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH")
        try:
            version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as exc:
            raise CpuKernelUnavailable(f"{compiler} --version failed: {exc}") from exc
        source = SOURCE.read_bytes()
        digest = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(_FLAGS).encode(),
                                            _cpu_flags().encode()])).hexdigest()[:16]
        build_dir = Path(build_dir)
        self.path = build_dir / f"paged_decode_cpu-{digest}.so"
        if not self.path.exists():
            build_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=build_dir, suffix=".so.tmp")
            os.close(fd)
            try:
                done = subprocess.run([compiler, *_FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
                if done.returncode != 0:
                    raise CpuKernelUnavailable(f"compiling {SOURCE.name} failed:\n{done.stderr[-2000:]}")
                os.replace(tmp, self.path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        try:
            library = ctypes.CDLL(str(self.path))
        except OSError as exc:
            raise CpuKernelUnavailable(f"loading {self.path} failed: {exc}") from exc
        self._functions = {}
        for dtype, symbol in _SYMBOLS.items():
            function = getattr(library, symbol)
            function.argtypes = _ARGTYPES
            function.restype = None
            self._functions[dtype] = function

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

        Raises:
            ValueError: the inputs break the contract (as the Triton kernel's checks), a tensor is not on the
                CPU, or a last dimension is not contiguous.
        """
        _check(query, k_cache, v_cache, block_tables, context_lens, num_splits, out, workspace)
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
        _, block_size, num_kv_heads, _ = k_cache.shape
        strides = [(ctypes.c_int64 * 3)(*t.stride()[:3]) for t in (query, k_cache, v_cache, out)]
        self._functions[query.dtype](
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            context_lens.data_ptr(), out.data_ptr(), batch, num_q_heads, num_kv_heads, head_dim, block_size,
            strides[0], strides[1], strides[2], block_tables.stride(0), strides[3], scale)
        return out
