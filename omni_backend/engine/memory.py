"""How many KV-cache blocks the engine allocates.

Order of precedence: an explicit block count (tests), then an explicit byte budget (`kv_cache_bytes`, the
`OMNI_KV_CACHE_BYTES` setting, honoured on CPU and GPU alike), then the device's default: 512 MiB on CPU, and
on a GPU what is left of `total x gpu_memory_utilization` after this engine's own peak use, measured by
profiling (as vLLM's worker does, Kwon et al., SOSP 2023, section 4.3): the weights, one prefill step of
`max_num_batched_tokens` tokens with the sampler's `[max_num_seqs, vocab]` temporaries, and the memory the
CUDA-graph pool will hold (one eager decode step at the largest captured batch size). The budget is also capped
by the memory actually free, so stages and processes that loaded earlier on the same GPU are never overrun.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from omni_backend import checkpoints

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
CPU_DEFAULT_KV_CACHE_BYTES = 512 * MIB
# Kept free beside the KV cache on a GPU: allocator fragmentation and the cuBLAS workspace each new stream or
# handle allocates outside the profiled step (sized by CUBLAS_WORKSPACE_CONFIG; several MiB each).
GPU_HEADROOM_BYTES = 256 * MIB


def kv_block_bytes(hf_config, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """Bytes of one block across all layers, K and V: 2 * layers * block_size * kv_heads * head_dim * size.
    `num_kv_heads`: the KV heads one tensor-parallel rank holds (default: the model's)."""
    head_dim = checkpoints.head_dim(hf_config)
    element = torch.empty((), dtype=dtype).element_size()
    kv_heads = hf_config.num_key_value_heads if num_kv_heads is None else num_kv_heads
    return 2 * hf_config.num_hidden_layers * block_size * kv_heads * head_dim * element


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The paged KV cache: per layer (K, V), each zeros [num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


@dataclass(frozen=True)
class GpuMemoryProfile:
    """What a GPU engine measured before sizing its KV cache (bytes).

    Attributes:
        total: the device's memory (`cudaMemGetInfo`).
        free: free memory after profiling, with the caching allocator's unused blocks released: what every
            process on the device (this one's weights included) leaves.
        peak_torch: this process's peak reserved memory during profiling: weights + one profiled step.
        weights: memory held after profiling (the weights and other persistent tensors).
        graph_pool: memory the CUDA-graph pool is expected to hold (0 when no graphs are captured).
    """

    total: int
    free: int
    peak_torch: int
    weights: int
    graph_pool: int


@dataclass(frozen=True)
class KVCachePlan:
    """The chosen KV cache: `num_blocks` blocks of `block_bytes`; `reason` says how (for the log)."""

    num_blocks: int
    block_bytes: int
    reason: str

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def plan_kv_cache(block_bytes: int, *, num_kv_blocks: int | None = None, kv_cache_bytes: int = 0,
                  gpu: GpuMemoryProfile | None = None, gpu_memory_utilization: float | None = None) -> KVCachePlan:
    """The KV cache size (see the module docstring for the rules).

    Args:
        block_bytes: bytes of one block (`kv_block_bytes`).
        num_kv_blocks: explicit block count, or None.
        kv_cache_bytes: explicit budget in bytes, or 0 for the device default.
        gpu: the profile of a GPU engine; None on CPU.
        gpu_memory_utilization: fraction of the GPU's total memory this engine may use, in (0, 1] (EngineConfig's
            setting); needed with `gpu` when neither count nor bytes are given.

    Raises:
        ValueError: the budget holds no block (the message gives the numbers and what to change), or a GPU plan
            without `gpu_memory_utilization`.
    """
    if num_kv_blocks is not None:
        plan = KVCachePlan(num_kv_blocks, block_bytes, "num_kv_blocks setting")
    elif kv_cache_bytes:
        plan = KVCachePlan(kv_cache_bytes // block_bytes, block_bytes, f"kv_cache_bytes setting ({kv_cache_bytes})")
    elif gpu is None:
        plan = KVCachePlan(CPU_DEFAULT_KV_CACHE_BYTES // block_bytes, block_bytes, "CPU default (512 MiB)")
    else:
        if gpu_memory_utilization is None or not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        share = int(gpu.total * gpu_memory_utilization) - gpu.peak_torch - gpu.graph_pool - GPU_HEADROOM_BYTES
        activations = gpu.peak_torch - gpu.weights
        free = gpu.free - activations - gpu.graph_pool - GPU_HEADROOM_BYTES
        budget = min(share, free)
        bound = "utilisation share" if share <= free else "free memory (other processes or stages hold the rest)"
        gib = 2**30
        plan = KVCachePlan(max(0, budget) // block_bytes, block_bytes,
                           f"{gpu_memory_utilization:.2f} x {gpu.total / gib:.1f} GiB - peak {gpu.peak_torch / gib:.2f} "
                           f"GiB (weights {gpu.weights / gib:.2f}) - graph pool {gpu.graph_pool / gib:.2f} GiB - "
                           f"headroom, capped by the {gpu.free / gib:.1f} GiB free; bound by the {bound}")
    if plan.num_blocks < 1:
        raise ValueError(f"the KV cache budget holds no block of {block_bytes} bytes ({plan.reason}): raise "
                         "gpu_memory_utilization / kv_cache_bytes, or lower max_num_batched_tokens or max_num_seqs")
    return plan
