"""The torch backend: every operation through the vectorised torch references of `kernels/` (the reference the
other backends are tested and self-tested against, and the fallback where their kernels cannot run).

Decode gathers each sequence's K/V heads-first from the paged cache (`kernels._paged.kv_gather`, its slot list
built by the step's first layer and reused by the others) and runs torch's `scaled_dot_product_attention` with
fp32 scores. Sizing the gather waits for the device (`.item()`), so a decode step through it cannot be captured in
a CUDA graph.
"""

from __future__ import annotations

import torch

from kernels import paged_decode, paged_prefill, store_kv
from kernels._paged import kv_gather
from omni_backend.engine.attention.interface import AttentionBackend, AttentionMetadata


class TorchAttention(AttentionBackend):
    """`AttentionBackend` through the torch references (see the module docstring)."""

    name = "torch"
    store_kernel = staticmethod(store_kv.store_kv_reference)
    prefill_kernel = staticmethod(paged_prefill.paged_prefill_attention_reference)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.decode_gather is None:  # same slots for every layer: build once per step (one host sync)
            max_len = int(meta.decode_context_lens.max().item())
            meta.decode_gather = kv_gather(meta.decode_block_tables, meta.decode_context_lens, max_len,
                                           k_cache.shape[1])
        return paged_decode.paged_decode_attention_reference(q, k_cache, v_cache, meta.decode_block_tables,
                                                             meta.decode_context_lens, self.scale,
                                                             gather=meta.decode_gather)
