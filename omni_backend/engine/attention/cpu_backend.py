"""The cpu backend (the CPU default): decode attention through the C++ kernel of `kernels/paged_decode_cpu.py`
(built on first use), which reads each sequence's K/V in place from its blocks; prefill with float32 queries (the
C++ CPU step's, and float32 models') through the C++ kernel of `kernels/paged_prefill_cpu.py`, other prefills
(bfloat16 queries, shapes it does not take) and `store` through the torch references, as the torch backend runs
them.

A fused CPU step (kernels/cpu_decode_step.py) calls the same kernel for its decode rows from C++: it takes it
from `cpu_decode_kernel`, so it runs only with this backend.
"""

from __future__ import annotations

import torch

from kernels.paged_decode_cpu import CpuPagedDecode
from kernels.paged_prefill_cpu import CpuPagedPrefill
from omni_backend.engine.attention.interface import AttentionMetadata
from omni_backend.engine.attention.torch_backend import TorchAttention


class CpuAttention(TorchAttention):
    """`AttentionBackend` with the C++ decode and prefill kernels (see the module docstring).

    Args:
        scale: softmax scale.
        kernel_build_dir: folder for the compiled kernel.

    Raises:
        ValueError: no `kernel_build_dir`.
        kernels.cpu_library.CpuKernelUnavailable: a kernel cannot be built or loaded here.
    """

    name = "cpu"

    def __init__(self, scale: float, kernel_build_dir: str | None = None):
        super().__init__(scale)
        if kernel_build_dir is None:
            raise ValueError("the cpu attention backend needs kernel_build_dir")
        self._kernel = CpuPagedDecode(kernel_build_dir)
        self._prefill_kernel = CpuPagedPrefill(kernel_build_dir)

    @property
    def cpu_decode_kernel(self) -> CpuPagedDecode:
        return self._kernel

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self._kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale)

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if not self._prefill_kernel.supports(q, k_cache):
            return super().prefill(q, k_cache, v_cache, meta)
        return self._prefill_kernel(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                                    meta.prefill_context_lens, self.scale)
