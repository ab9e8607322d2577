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
from kernels.paged_decode import DecodeWorkspace
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
        decode_num_splits: KV partitions of the triton backend's split-KV decode kernel, fixed per decode batch
            size (so a captured CUDA graph keeps its launch); None: the kernel's own default.
        decode_workspace: the triton backend's preallocated split partials for `decode_num_splits` (None: the
            kernel allocates them, which is fine eagerly but not inside a captured graph).
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
    decode_num_splits: int | None = None
    decode_workspace: DecodeWorkspace | None = None
    decode_gather: KVGather | None = None


class PagedAttention:
    """Attention over the paged KV cache with a chosen implementation.

    Args:
        backend: "cpu", "torch" or "triton" (see the module docstring).
        scale: softmax scale, usually head_dim ** -0.5.
        kernel_build_dir: folder for the "cpu" backend's compiled kernel.

    Raises:
        ValueError: unknown backend, or "cpu" without `kernel_build_dir`.
        kernels.cpu_library.CpuKernelUnavailable: the "cpu" backend's kernel cannot be built here.
    """

    def __init__(self, backend: str, scale: float, kernel_build_dir: str | None = None):
        if backend not in ("cpu", "torch", "triton"):
            raise ValueError(f"unknown attention backend {backend!r}")
        self.backend = backend
        self.scale = scale
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

    @property
    def decode_kernel(self) -> CpuPagedDecode | None:
        """The cpu backend's built C++ decode kernel (None for the other backends)."""
        return self._decode if self.backend == "cpu" else None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> output [T, Hq, D] (q's dtype): stores k/v at the step's slots, then
        `attend`."""
        self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q [T, Hq, D] (unit stride in D) over the paged cache, which already holds the step's own
        K/V -> output [T, Hq, D] (q's dtype): causal over each prefill chunk's context, single-query for the
        decode rows."""
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
                                self.scale, num_splits=meta.decode_num_splits, workspace=meta.decode_workspace)
        if self.backend == "cpu":
            return self._decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                self.scale)
        if meta.decode_gather is None:  # same slots for every layer: build once per step (one host sync)
            max_len = int(meta.decode_context_lens.max().item())
            meta.decode_gather = kv_gather(meta.decode_block_tables, meta.decode_context_lens, max_len,
                                           k_cache.shape[1])
        return self._decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale,
                            gather=meta.decode_gather)


# Output tolerances of the startup self-test against the torch reference: those of tests/kernels (fp32 exact "ieee"
# dots; fp16 10 mantissa bits; bf16 8 bits, whose rounding step at |x| >= 4 is already 0.03).
SELF_TEST_ATOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 5e-2}


def self_test(attention: PagedAttention, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device, block_size: int) -> str | None:
    """Run `attention`'s store_kv + prefill + decode once on random data against the torch backend.

    One mixed step at the model's head shapes and dtype: a 37-token prompt, a 9-token chunk after 20 cached
    tokens, and two decodes (contexts 50 and 1), over randomly placed blocks, with a 2-way split-KV decode and
    its workspace for the triton backend (as the engine runs it). Compares the output to the torch backend
    within SELF_TEST_ATOL and the written cache slots exactly.

    Returns:
        None when it agrees, else why not (an exception's type and message, or the largest difference), for
        the warning that falls back to the torch backend.
    """
    from kernels.paged_decode import alloc_decode_workspace

    gen = torch.Generator().manual_seed(0)
    new = [37, 9, 1, 1]  # tokens computed this step per sequence: 2 prefill chunks, then 2 decodes
    contexts = [37, 29, 50, 1]
    blocks_per_seq = -(-max(contexts) // block_size)
    num_blocks = len(contexts) * blocks_per_seq + 1
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1)[:len(contexts) * blocks_per_seq]
    tables = tables.view(len(contexts), blocks_per_seq).to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    slots = [int(tables[s, p // block_size]) * block_size + p % block_size
             for s, (n, c) in enumerate(zip(new, contexts)) for p in range(c - n, c)]
    tokens = sum(new)
    q = torch.randn(tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype)

    def run(backend: PagedAttention, splits: int | None, workspace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kc, vc = k_cache.to(device), v_cache.to(device)
        tables_d = tables.to(device)
        ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), num_prefill_tokens=new[0] + new[1],
            prefill_query_start_loc=torch.tensor([0, new[0], new[0] + new[1]], dtype=torch.int32, device=device),
            prefill_context_lens=ctx[:2], prefill_block_tables=tables_d[:2],
            decode_context_lens=ctx[2:], decode_block_tables=tables_d[2:],
            decode_num_splits=splits, decode_workspace=workspace)
        out = backend(q.to(device), k.to(device), v.to(device), kc, vc, meta)
        return out.float().cpu(), kc.cpu(), vc.cpu()

    try:
        splits = 2 if attention.backend == "triton" else None
        workspace = alloc_decode_workspace(2, num_q_heads, head_dim, 2, device) if splits else None
        got, got_k, got_v = run(attention, splits, workspace)
        want, want_k, want_v = run(PagedAttention("torch", attention.scale), None, None)
    except Exception as exc:  # any failure to compile, load or launch is what this test is for
        return f"{type(exc).__name__}: {exc}"
    if not (torch.equal(got_k, want_k) and torch.equal(got_v, want_v)):
        return "store_kv wrote other cache contents than the torch reference"
    error = (got - want).abs().max().item()
    if not error <= SELF_TEST_ATOL[dtype]:  # also catches NaN
        return f"output differs from the torch reference by {error:.3g} (tolerance {SELF_TEST_ATOL[dtype]:g})"
    return None
