"""Paged attention behind one interface, with three backends:

- ``triton``: the OpenAI-Triton kernels in ``kernels/`` (GPU default; on CPU only under TRITON_INTERPRET=1).
- ``cpu``: decode through the C++ kernel of ``kernels/paged_decode_cpu.py`` (built on first use), which reads
  K/V in place from the blocks; ``store_kv`` and prefill through the torch references (CPU default).
- ``torch``: every operation through the vectorised torch references (CPU fallback where no C++ compiler is).

A step's tokens are laid out prefill chunks first, then decodes (one token each). Every layer writes the step's
new K/V into cache slots (`store_kv`), runs causal attention over the paged cache for the prefill part and
single-query paged attention for the decode part. The model never knows which backend runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels import paged_decode, paged_prefill, store_kv
from kernels._paged import KVGather, kv_gather
from kernels.paged_decode_cpu import CpuPagedDecode

logger = logging.getLogger(__name__)


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
        decode_gather: the torch backend's cache slots of the decode rows, built by its first layer of the
            step and reused by the others (None until then, and always with the triton and cpu backends).
    """

    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    prefill_query_start_loc: torch.Tensor | None
    prefill_context_lens: torch.Tensor | None
    prefill_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    decode_block_tables: torch.Tensor | None
    decode_gather: KVGather | None = None


class PagedAttention:
    """Attention over the paged KV cache with a chosen implementation.

    Args:
        backend: "cpu", "torch" or "triton" (see the module docstring).
        scale: softmax scale, usually head_dim ** -0.5.
        num_splits: KV splits of the split-KV decode kernel (static, so the launch is graph-capturable).
        kernel_build_dir: folder for the "cpu" backend's compiled kernel.

    Raises:
        ValueError: unknown backend, or "cpu" without `kernel_build_dir`.
        kernels.paged_decode_cpu.CpuKernelUnavailable: the "cpu" backend's kernel cannot be built here.
    """

    def __init__(self, backend: str, scale: float, num_splits: int = 4, kernel_build_dir: str | None = None):
        if backend not in ("cpu", "torch", "triton"):
            raise ValueError(f"unknown attention backend {backend!r}")
        self.backend = backend
        self.scale = scale
        self.num_splits = num_splits
        if backend == "triton":
            self._store = store_kv.store_kv
            self._prefill = paged_prefill.paged_prefill_attention
            self._decode = paged_decode.paged_decode_attention
            return
        self._store = store_kv.store_kv_reference
        self._prefill = paged_prefill.paged_prefill_attention_reference
        if backend == "torch":
            self._decode = paged_decode.paged_decode_attention_reference
        else:
            if kernel_build_dir is None:
                raise ValueError("the cpu attention backend needs kernel_build_dir")
            self._decode = CpuPagedDecode(kernel_build_dir)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> output [T, Hq, D] (q's dtype)."""
        self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        num_prefill = meta.num_prefill_tokens
        if num_prefill == q.shape[0]:
            return self._prefill(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                                 meta.prefill_context_lens, self.scale)
        if num_prefill == 0:
            return self._decode_rows(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        out[:num_prefill] = self._prefill(q[:num_prefill], k_cache, v_cache, meta.prefill_block_tables,
                                          meta.prefill_query_start_loc, meta.prefill_context_lens, self.scale)
        out[num_prefill:] = self._decode_rows(q[num_prefill:], k_cache, v_cache, meta)
        return out

    def _decode_rows(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
        if self.backend == "triton":
            return self._decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                self.scale, num_splits=self.num_splits)
        if self.backend == "cpu":
            return self._decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                self.scale)
        if meta.decode_gather is None:  # same slots for every layer: build once per step (one host sync)
            max_len = int(meta.decode_context_lens.max().item())
            meta.decode_gather = kv_gather(meta.decode_block_tables, meta.decode_context_lens, max_len,
                                           k_cache.shape[1])
        return self._decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale,
                            gather=meta.decode_gather)
