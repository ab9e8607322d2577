"""Shared builders and checks for the kernel tests (paged caches poisoned with NaN)."""

from __future__ import annotations

import math
import os

import torch

from kernels.paged_decode import alloc_decode_workspace

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
# bf16 arithmetic is wrong under the Triton interpreter, so bf16 runs only on a GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# bf16 has 8 mantissa bits: one rounding step at |x| >= 4 is already 0.03, so add a relative term.
RTOL = {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 1e-2}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKV:
    """A NaN-poisoned paged cache holding random K/V for the first ``lens[i]`` tokens of each row.

    Blocks are assigned from a random permutation of ``1..num_blocks-1``; every unused slot (tails
    of last blocks, spare blocks) is NaN, and block 0 is entirely NaN, so code that maps masked
    positions to block 0 and then lets the values through is caught too. Block-table entries past
    a row's length are garbage: block 0, ``-1`` or an id past the end of the cache.
    ``table_width``: block-table columns (default: the longest row's blocks + 1), e.g. an engine's
    ``max_model_len / block_size``, much wider than the contexts.
    """

    def __init__(self, lens, block_size, num_kv_heads, head_dim, dtype, gen, spare_blocks=2, table_width=None):
        self.block_size = block_size
        needed = [cdiv(n, block_size) for n in lens]
        max_blocks = max(needed + [1]) + 1 if table_width is None else table_width
        if max_blocks < max(needed + [0]):
            raise ValueError(f"table_width {max_blocks} cannot hold {max(needed)} blocks")
        num_blocks = sum(needed) + spare_blocks + 1
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        garbage = torch.tensor([0, -1, num_blocks + 1000], dtype=torch.int32)
        tables = garbage[torch.randint(0, 3, (len(lens), max_blocks), generator=gen)]
        for i, n in enumerate(lens):
            for j in range(needed[i]):
                tables[i, j] = perm.pop()
            for p in range(n):
                blk, off = tables[i, p // block_size], p % block_size
                self.k_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
                self.v_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
        self.block_tables = tables
        self.k_cache, self.v_cache = self.k_cache.to(DEVICE), self.v_cache.to(DEVICE)
        self.block_tables = self.block_tables.to(DEVICE)

    def sequence(self, i: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of row i's first n tokens, ``[n, num_kv_heads, head_dim]`` float64, one token at a time."""
        ks, vs = [], []
        for p in range(n):
            blk = int(self.block_tables[i, p // self.block_size])
            ks.append(self.k_cache[blk, p % self.block_size].double())
            vs.append(self.v_cache[blk, p % self.block_size].double())
        shape = (0,) + tuple(self.k_cache.shape[2:])
        return (torch.stack(ks) if ks else torch.empty(shape, dtype=torch.float64, device=DEVICE),
                torch.stack(vs) if vs else torch.empty(shape, dtype=torch.float64, device=DEVICE))


def bad_decode_overrides(kv: PagedKV, query: torch.Tensor, context_lens: torch.Tensor) -> list[dict]:
    """Argument overrides that break the paged decode contract (kernels/paged_decode.py), each one a ValueError
    for every implementation: wrong dtypes, shapes or strides, and num_splits/workspace misuse."""
    device = query.device
    return [
        dict(block_tables=kv.block_tables.long()),
        dict(context_lens=context_lens.long()),
        dict(context_lens=context_lens[:1]),
        dict(context_lens=torch.stack([context_lens, context_lens], 1)[:, 0]),  # strided
        dict(block_tables=torch.stack([kv.block_tables, kv.block_tables], 2)[..., 0]),  # strided rows
        dict(query=query[:, :3]),  # 3 q heads, 2 kv heads
        dict(query=query[..., :8]),
        dict(query=query.half()),
        dict(k_cache=kv.k_cache[:, :0], v_cache=kv.v_cache[:, :0]),  # block_size 0: kernels divide by it
        dict(num_splits=0),
        dict(out=torch.empty(2, 4, 8, device=device)),
        dict(workspace=alloc_decode_workspace(2, 4, 16, 2, device)),  # num_splits missing
        dict(num_splits=3, workspace=alloc_decode_workspace(2, 4, 16, 2, device)),
    ]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos, scale: float) -> torch.Tensor:
    """Float64 softmax attention for one sequence, head by head.

    q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]``, q_pos: absolute positions of the queries (query i sees
    keys ``<= q_pos[i]``). Returns ``[Lq, Hq, D]`` float64.
    """
    q = q.double()
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for h in range(q.shape[1]):
        kh, vh = k[:, h // group], v[:, h // group]
        for i, pos in enumerate(q_pos):
            scores = (kh[: pos + 1] @ q[i, h]) * scale
            w = torch.softmax(scores, dim=0)
            out[i, h] = w @ vh[: pos + 1]
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str = "") -> None:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise, rtol from RTOL[actual.dtype]."""
    assert not torch.isnan(actual).any(), f"{what}: NaN in output (out-of-range cache read?)"
    if not actual.numel():
        return
    rtol = RTOL.get(actual.dtype, 0.0)
    excess = (actual.double() - expected.double()).abs() - rtol * expected.double().abs()
    err = excess.max().item()
    assert err <= atol, f"{what}: max error {err:.3g} (beyond rtol {rtol:g}) > atol {atol:g}"


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
