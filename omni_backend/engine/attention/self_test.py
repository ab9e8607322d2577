"""The start-up self-test of an attention backend against the torch reference (`selector.py` runs it once)."""

from __future__ import annotations

import torch

from omni_backend.engine.attention.interface import AttentionBackend, AttentionMetadata
from omni_backend.engine.attention.torch_backend import TorchAttention

# Output tolerances against the torch reference: those of tests/kernels (fp32 exact "ieee" dots; fp16 10 mantissa
# bits; bf16 8 bits, whose rounding step at |x| >= 4 is already 0.03).
SELF_TEST_ATOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 5e-2}


def self_test(attention: AttentionBackend, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device, block_size: int) -> str | None:
    """Run `attention`'s store + prefill + decode once on random data against the torch backend.

    One mixed step at the model's head shapes and dtype: a 37-token prompt, a 9-token chunk after 20 cached
    tokens, and two decodes (contexts 50 and 1), over randomly placed blocks, with a 2-way split-KV decode and its
    workspace where the backend splits (`decode_plan`, as the engine runs it). Compares the output to the torch
    backend within SELF_TEST_ATOL and the written cache slots exactly. A backend that serves the C++ CPU step
    (`cpu_decode_kernel`) over a 16-bit cache also runs the prefill with float32 queries, as that step does (the
    cpu backend's C++ prefill kernel, on bfloat16 its vdpbf16ps path where it is chosen), within the same tolerance.

    Returns:
        None when it agrees, else why not (an exception's type and message, or the largest difference), for
        the warning that falls back to the torch backend.
    """
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

    def metadata(plan: tuple) -> AttentionMetadata:
        tables_d = tables.to(device)
        ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), num_prefill_tokens=new[0] + new[1],
            prefill_query_start_loc=torch.tensor([0, new[0], new[0] + new[1]], dtype=torch.int32, device=device),
            prefill_context_lens=ctx[:2], prefill_block_tables=tables_d[:2],
            decode_context_lens=ctx[2:], decode_block_tables=tables_d[2:],
            decode_num_splits=plan[0], decode_workspace=plan[1])

    def run(backend: AttentionBackend, plan: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kc, vc = k_cache.to(device), v_cache.to(device)
        out = backend(q.to(device), k.to(device), v.to(device), kc, vc, metadata(plan))
        return out.float().cpu(), kc.cpu(), vc.cpu()

    def float32_prefill(backend: AttentionBackend, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """The C++ CPU step's prefill: float32 queries over the 16-bit caches (another kernel path)."""
        return backend.prefill(q[: new[0] + new[1]].float().to(device), kc.to(device), vc.to(device),
                               metadata((None, None))).cpu()

    reference = TorchAttention(attention.scale)
    mixed = dtype != torch.float32 and attention.cpu_decode_kernel is not None
    try:
        plan = attention.decode_plan(2, num_q_heads, num_kv_heads, head_dim, blocks_per_seq * block_size, device,
                                     num_splits=2)
        got, got_k, got_v = run(attention, plan)
        want, want_k, want_v = run(reference, (None, None))
        if mixed:
            got_mixed, want_mixed = float32_prefill(attention, got_k, got_v), float32_prefill(reference, got_k, got_v)
    except Exception as exc:  # any failure to compile, load or launch is what this test is for
        return f"{type(exc).__name__}: {exc}"
    if not (torch.equal(got_k, want_k) and torch.equal(got_v, want_v)):
        return "store_kv wrote other cache contents than the torch reference"
    for what, error in [("output", (got - want).abs().max().item())] + (
            [("float32-query prefill", (got_mixed - want_mixed).abs().max().item())] if mixed else []):
        if not error <= SELF_TEST_ATOL[dtype]:  # also catches NaN
            return f"{what} differs from the torch reference by {error:.3g} (tolerance {SELF_TEST_ATOL[dtype]:g})"
    return None
