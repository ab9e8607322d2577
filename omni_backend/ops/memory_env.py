"""Environment that bounds and steadies the native memory of engine processes (glibc malloc, oneDNN caches).

glibc: by default it returns freed memory to the kernel (large blocks are mmap'd and unmapped on free; the heap
top is trimmed). On VMs with free-page reporting (Firecracker here) every re-touched page then faults back
from the host: measured on this project's CPU machine, one 1024-token SmolLM2 prefill step took 10-16 s that
way and 1.4 s with `GLIBC_TUNABLES` below, which keep freed memory in the process for reuse (glibc manual,
"Memory Allocation Tunables").

oneDNN: torch runs bf16 matmuls on CPU through oneDNN (via ideep), which JIT-compiles a primitive for every new
problem shape and keeps it in two LRU caches of 1024 entries each by default: oneDNN's primitive cache
(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, oneDNN docs "Primitive Cache") and ideep's own (`LRU_CACHE_CAPACITY`).
The engine's shapes change with the batch, the context length and every prefill chunk, so a serving process
kept compiling new primitives until both caches were full: measured, about 1 MiB of RSS per cached shape,
the +20 % (1,334 -> 1,600 MiB) growth of the llm stub over a 10-minute soak. A decode step uses each shape
for all of its layers, so a step needs only its own handful of shapes cached; 64 entries bound the caches to
about 70 MiB. Engine throughput (offline bench, bf16): 423 tok/s with 64 entries against 444 with the default
in one pair of runs, inside this machine's run-to-run spread (347-458 tok/s for the same code); a soak with
64 entries: llm stub +0.03 % RSS (benchmarks/results/soak.json).
"""

from __future__ import annotations

import os
import sys

MALLOC_TUNABLES = ("glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296:"
                   "glibc.malloc.top_pad=268435456")
"""Value for GLIBC_TUNABLES: mmap only above 32 MiB (glibc's maximum threshold), never trim, grow by 256 MiB."""

ONEDNN_CACHE_CAPACITY = 64
"""Entries in each of oneDNN's and ideep's primitive caches (LRU). Measured with both at N: RSS grows by about
0.9 MiB per entry until full (N=64: +70 MiB, N=256: +232 MiB, default 1024: +880 MiB and still growing)."""


def memory_environment() -> dict[str, str]:
    """The variables to set before an engine process starts: glibc reads GLIBC_TUNABLES when the process starts,
    oneDNN and ideep read their capacities once, when the first bf16 matmul runs."""
    return {"GLIBC_TUNABLES": MALLOC_TUNABLES,
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_CACHE_CAPACITY),
            "LRU_CACHE_CAPACITY": str(ONEDNN_CACHE_CAPACITY)}


def reexec_with_memory_environment() -> None:
    """Re-exec the running Python script (same interpreter flags and arguments) with `memory_environment()`'s
    variables where the environment lacks them, so an in-process benchmark runs under the server's settings (they
    are read at process start: without them the measured code faults in pages a server keeps). Returns only when
    nothing was missing.

    Raises:
        OSError: the exec failed.
    """
    missing = {name: value for name, value in memory_environment().items() if name not in os.environ}
    if missing:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **missing})


if __name__ == "__main__":  # shell: eval "$(python -m omni_backend.ops.memory_env)"
    for name, value in memory_environment().items():
        print(f'export {name}="${{{name}:-{value}}}"')
