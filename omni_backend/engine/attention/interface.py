"""The paged attention interface every backend implements, and the per-step metadata it reads.

A step's tokens are laid out prefill chunks first, then decodes (one token each). Every layer writes the step's
new K/V into cache slots (`store`), runs causal attention over the paged cache for the prefill part and
single-query paged attention for the decode part. The model calls an `AttentionBackend` and never knows which one
runs; `selector.py` picks it once at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels._paged import KVGather
from kernels.paged_decode import DecodeWorkspace
from kernels.paged_decode_cpu import CpuPagedDecode


@dataclass
class AttentionMetadata:
    """Per-step attention inputs (all on the engine's device).

    Attributes:
        slot_mapping: int64 [T], cache slot of each new token (-1: padding, not stored).
        num_prefill_tokens: P, the first P tokens belong to prefill chunks.
        prefill_query_start_loc: int32 [S+1], cumulative query lengths of the S prefill sequences.
        prefill_context_lens: int32 [S], KV length of each prefill sequence including its new tokens.
        prefill_block_tables: int32 [S, max_blocks_per_seq].
        decode_context_lens: int32 [D], KV length of each decode sequence including its new token.
        decode_block_tables: int32 [D, max_blocks_per_seq].
        decode_num_splits: KV partitions of a split-KV decode kernel, fixed per decode batch size (so a captured
            CUDA graph keeps its launch); None: the backend's own default (`AttentionBackend.decode_plan`).
        decode_workspace: the split partials preallocated for `decode_num_splits` (None: the kernel allocates
            them, which is fine eagerly but not inside a captured graph).
        decode_gather: the torch backend's cache slots of the decode rows, built by its first layer of the
            step and reused by the others (None until then, and always with the other backends).
    """

    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    prefill_query_start_loc: torch.Tensor | None
    prefill_context_lens: torch.Tensor | None
    prefill_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    decode_block_tables: torch.Tensor | None
    decode_num_splits: int | None = None
    decode_workspace: DecodeWorkspace | None = None
    decode_gather: KVGather | None = None


class AttentionBackend:
    """Attention over the paged KV cache; subclasses supply `store_kernel` and `prefill_kernel` (with the
    signatures of kernels/store_kv.py and kernels/paged_prefill.py, whose functions they are) and `decode`.

    Caches are [num_blocks, block_size, num_kv_heads, head_dim] per layer; q is [T, Hq, D], k/v [T, Hkv, D].

    Args:
        scale: softmax scale, usually head_dim ** -0.5.
        kernel_build_dir: where a backend whose kernels are compiled on this machine keeps them (the cpu
            backend's; the others take none).

    Attributes:
        name: "torch", "triton" or "cpu", as the `attention_backend` setting, logs and metrics call it.
        graph_safe: whether a decode step through it can be captured in a CUDA graph (no host synchronisation,
            no data-dependent shapes).
        compiles_per_shape: whether its kernels compile a specialisation per launch shape on first use, so the
            model runner compiles the shapes it will launch at start-up (`ModelRunner._warm_up`).
    """

    name = ""
    graph_safe = False
    compiles_per_shape = False
    store_kernel: Callable[..., None]
    prefill_kernel: Callable[..., torch.Tensor]

    def __init__(self, scale: float, kernel_build_dir: str | None = None):
        self.scale = scale

    def store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Write k/v [T, Hkv, D] into the caches at `slot_mapping` (rows at slot -1 are not stored)."""
        self.store_kernel(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Causal attention of the prefill rows q [P, Hq, D] over each chunk's context -> [P, Hq, D]."""
        return self.prefill_kernel(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                                   meta.prefill_context_lens, self.scale)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Single-query attention of the decode rows q [D, Hq, D] over their contexts -> [D, Hq, D]."""
        raise NotImplementedError

    def decode_plan(self, rows: int, num_q_heads: int, num_kv_heads: int, head_dim: int, capacity: int,
                    device: torch.device, num_splits: int | None = None
                    ) -> tuple[int | None, DecodeWorkspace | None]:
        """(decode_num_splits, decode_workspace) for a decode part of `rows` rows whose block tables hold
        `capacity` tokens: (None, None) for a backend without split-KV decode. `num_splits` forces a count."""
        return None, None

    @property
    def cpu_decode_kernel(self) -> CpuPagedDecode | None:
        """The built C++ decode kernel a fused CPU step (kernels/cpu_decode_step.py) calls for its decode rows in
        place of `decode`; None for a backend without one (a fused CPU step then runs op by op through `attend`)."""
        return None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> output [T, Hq, D] (q's dtype): stores k/v at the step's slots, then
        `attend`."""
        self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q [T, Hq, D] (unit stride in D) over the paged cache, which already holds the step's own
        K/V -> output [T, Hq, D] (q's dtype): causal over each prefill chunk's context, single-query for the
        decode rows."""
        num_prefill = meta.num_prefill_tokens
        if num_prefill == q.shape[0]:
            return self.prefill(q, k_cache, v_cache, meta)
        if num_prefill == 0:
            return self.decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        out[:num_prefill] = self.prefill(q[:num_prefill], k_cache, v_cache, meta)
        out[num_prefill:] = self.decode(q[num_prefill:], k_cache, v_cache, meta)
        return out


class DecodePlans:
    """The split-KV plan (`AttentionBackend.decode_plan`) of each decode batch-size bucket, made once per bucket.

    A decode part of n rows takes the plan of the smallest bucket >= n, so eager steps and the CUDA graph captured
    for that bucket launch the same; its workspace is allocated once and reused.

    Args:
        attention: the backend; bucket_sizes: ascending decode batch sizes, the last >= any decode part
            (`cuda_graphs.capture_batch_sizes`); num_q_heads, num_kv_heads, head_dim: the heads this engine (or
            tensor-parallel rank) attends with; capacity: tokens a block table holds; device: the engine's.
    """

    def __init__(self, attention: AttentionBackend, bucket_sizes, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, capacity: int, device: torch.device):
        self.attention, self.bucket_sizes = attention, tuple(bucket_sizes)
        self.heads = (num_q_heads, num_kv_heads, head_dim)
        self.capacity, self.device = capacity, device
        self._plans: dict[int, tuple[int | None, DecodeWorkspace | None]] = {}

    def __call__(self, num_decodes: int) -> tuple[int | None, DecodeWorkspace | None]:
        """(decode_num_splits, decode_workspace) for a decode part of `num_decodes` rows."""
        size = next(s for s in self.bucket_sizes if s >= num_decodes)
        if size not in self._plans:
            self._plans[size] = self.attention.decode_plan(size, *self.heads, self.capacity, self.device)
        return self._plans[size]
