"""glibc malloc settings for engine processes.

By default glibc returns freed memory to the kernel (large blocks are mmap'd and unmapped on free; the heap
top is trimmed). On VMs with free-page reporting (Firecracker here) every re-touched page then faults back
from the host: measured on this project's CPU machine, one 1024-token SmolLM2 prefill step took 10-16 s that
way and 1.4 s with these settings, which keep freed memory in the process for reuse (glibc manual,
"Memory Allocation Tunables").
"""

MALLOC_TUNABLES = ("glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296:"
                   "glibc.malloc.top_pad=268435456")
"""Value for GLIBC_TUNABLES: mmap only above 32 MiB (glibc's maximum threshold), never trim, grow by 256 MiB."""

if __name__ == "__main__":
    print(MALLOC_TUNABLES)
