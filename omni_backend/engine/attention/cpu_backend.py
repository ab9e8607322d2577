"""The cpu backend (the CPU default): decode attention through the C++ kernel of `kernels/paged_decode_cpu.py`
(built on first use), which reads each sequence's K/V in place from its blocks; `store` and prefill through the
torch references, as the torch backend runs them.

A fused CPU step (kernels/cpu_decode_step.py) calls the same kernel for its decode rows from C++: it takes it
from `cpu_decode_kernel`, so it runs only with this backend.
"""

from __future__ import annotations

import torch

from kernels.paged_decode_cpu import CpuPagedDecode
from omni_backend.engine.attention.interface import AttentionMetadata
from omni_backend.engine.attention.torch_backend import TorchAttention


class CpuAttention(TorchAttention):
    """`AttentionBackend` with the C++ decode kernel (see the module docstring).

    Args:
        scale: softmax scale.
        kernel_build_dir: folder for the compiled kernel.

    Raises:
        ValueError: no `kernel_build_dir`.
        kernels.cpu_library.CpuKernelUnavailable: the kernel cannot be built or loaded here.
    """

    name = "cpu"

    def __init__(self, scale: float, kernel_build_dir: str | None = None):
        super().__init__(scale)
        if kernel_build_dir is None:
            raise ValueError("the cpu attention backend needs kernel_build_dir")
        self._kernel = CpuPagedDecode(kernel_build_dir)

    @property
    def cpu_decode_kernel(self) -> CpuPagedDecode:
        return self._kernel

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self._kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale)
