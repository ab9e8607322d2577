"""The machine's limits, the yardstick scripts/bench_cpu_step.py measures the CPU step against: memory bandwidth
(a STREAM-like triad and a read-only pass) and the arithmetic peaks of register-only loops (``machine_limits.cpp``:
float32 FMA, AVX512-BF16 vdpbf16ps, AMX tdpbf16ps, VNNI vpdpbusd), built on first use (``kernels/cpu_library.py``).

Bandwidth: the triad is STREAM's (J. McCalpin, "Memory Bandwidth and Machine Balance in Current High Performance
Computers", IEEE TCCA Newsletter, 1995): ``a = b + s * c`` over arrays far larger than the caches, counted as STREAM
counts it, three arrays of bytes per pass (the write-allocate read of ``a`` not counted). A decode step at batch 1
only reads (its weights), so the read rate (a sum over one such array) is measured too: the bound such a step is
held to. Both run on the calling thread's OpenMP team (torch.set_num_threads), each array `mib` MiB (beyond
the last-level cache of the machines this project runs on), the best of a few passes after one that faults the
pages in. Peaks are FLOP per second of the same team, a multiply-add counted as 2.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch

from kernels.cpu_library import CpuLibrary

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
PEAKS = ("fma_f32", "dot_bf16", "amx_bf16", "dot_int8")
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class MachineLimits(CpuLibrary):
    """The built peak loops (`kernels.cpu_library.CpuLibrary`: built in ``build_dir`` on first use).

    Raises:
        kernels.cpu_library.CpuKernelUnavailable: the library cannot be built or loaded here.
    """

    SOURCE = Path(__file__).with_name("machine_limits.cpp")
    FLAGS = _FLAGS
    SIGNATURES = {**{f"peak_{name}": ([ctypes.c_int64], ctypes.c_double) for name in PEAKS},
                  "triad_seconds": ([_PTR, _PTR, _PTR, _I64, _I64], ctypes.c_double),
                  "read_seconds": ([_PTR, _I64, _I64, _PTR], ctypes.c_double)}

    def peak_flops(self, name: str, seconds: float = 0.2, repeats: int = 3) -> float:
        """The best of `repeats` runs of the `name` loop (one of PEAKS), each about `seconds` long; 0.0 where this
        CPU or build lacks the instruction."""
        run = self._fn[f"peak_{name}"]
        iters = 1 << 16
        while True:  # size the run: double until it takes a tenth of `seconds`
            start = time.perf_counter()
            rate = run(iters)
            if rate == 0.0 or time.perf_counter() - start >= seconds / 10:
                break
            iters *= 2
        iters = int(iters * seconds / max(time.perf_counter() - start, 1e-9))
        return max([rate] + [run(max(iters, 1)) for _ in range(repeats)]) if rate else 0.0

    def triad_bytes_per_s(self, mib: int = 256, repeats: int = 5) -> float:
        """STREAM triad bytes per second (3 arrays per pass; see the module docstring)."""
        n = mib * 2**20 // 4
        a, b, c = torch.zeros(n), torch.rand(n), torch.rand(n)
        return 3 * 4 * n / self._fn["triad_seconds"](a.data_ptr(), b.data_ptr(), c.data_ptr(), n, repeats + 1)

    def read_bytes_per_s(self, mib: int = 512, repeats: int = 5) -> float:
        """Read-only bytes per second (see the module docstring)."""
        n = mib * 2**20 // 4
        a, sink = torch.rand(n), torch.zeros(1)
        return 4 * n / self._fn["read_seconds"](a.data_ptr(), n, repeats + 1, sink.data_ptr())
