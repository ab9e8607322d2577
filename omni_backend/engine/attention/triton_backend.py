"""The triton backend (the GPU default; on CPU only under TRITON_INTERPRET=1): the OpenAI-Triton kernels of
`kernels/store_kv.py`, `kernels/paged_prefill.py` and `kernels/paged_decode.py` (split-KV flash-decoding with a
reduce pass).

Nothing in a launch depends on context values, so decode steps can be captured in CUDA graphs; Triton compiles a
specialisation per argument shape class on first use, which the model runner compiles at start-up.
"""

from __future__ import annotations

import torch

from kernels import paged_decode, paged_prefill, store_kv
from kernels.paged_decode import DecodeWorkspace, alloc_decode_workspace, default_num_splits
from omni_backend.engine.attention.interface import AttentionBackend, AttentionMetadata


class TritonAttention(AttentionBackend):
    """`AttentionBackend` through the Triton kernels (see the module docstring)."""

    name = "triton"
    graph_safe = True
    compiles_per_shape = True
    store_kernel = staticmethod(store_kv.store_kv)
    prefill_kernel = staticmethod(paged_prefill.paged_prefill_attention)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        return paged_decode.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                                   meta.decode_context_lens, self.scale,
                                                   num_splits=meta.decode_num_splits, workspace=meta.decode_workspace)

    def decode_plan(self, rows: int, num_q_heads: int, num_kv_heads: int, head_dim: int, capacity: int,
                    device: torch.device, num_splits: int | None = None) -> tuple[int, DecodeWorkspace]:
        """`default_num_splits` for `rows` (unless `num_splits` is given) and a workspace for them."""
        splits = num_splits or default_num_splits(rows, num_kv_heads, capacity)
        return splits, alloc_decode_workspace(rows, num_q_heads, head_dim, splits, device)
