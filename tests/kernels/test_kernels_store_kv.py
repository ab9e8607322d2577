"""store_kv: Triton kernel vs torch reference, -1 slots skipped, strided caches, input checks."""

import pytest
import torch
from kernel_testing import DEVICE, DTYPES

from kernels.store_kv import store_kv, store_kv_reference


def _caches(num_blocks, block_size, heads, head_dim, dtype, strided=False):
    if strided:  # K and V as interleaved halves of one allocation: non-contiguous views
        kv = torch.full((num_blocks, block_size, 2, heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
        return kv[:, :, 0], kv[:, :, 1]
    shape = (num_blocks, block_size, heads, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
            torch.full(shape, float("nan"), dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("strided", [False, True])
# KV heads and head_dim: odd sizes, then SmolLM2-135M's (3, 64) and an 8B Llama-3-class model's (8, 128).
@pytest.mark.parametrize("heads,head_dim", [(2, 24), (3, 64), (8, 128)])
def test_store_kv_matches_reference_and_skips_padding(dtype, block_size, strided, heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    num_blocks, tokens = 5, 21
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[0, 7, 20]] = -1  # padding tokens
    slots = slots.to(DEVICE)
    key = torch.randn(tokens, heads, head_dim, generator=gen).to(DEVICE, dtype)
    value = torch.randn(tokens, heads, head_dim, generator=gen).to(DEVICE, dtype)

    k_ref, v_ref = _caches(num_blocks, block_size, heads, head_dim, dtype, strided)
    k_tri, v_tri = _caches(num_blocks, block_size, heads, head_dim, dtype, strided)
    assert store_kv_reference(key, value, k_ref, v_ref, slots) is None
    assert store_kv(key, value, k_tri, v_tri, slots) is None

    # Bitwise equal including which slots stayed NaN.
    torch.testing.assert_close(k_tri, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_tri, v_ref, rtol=0, atol=0, equal_nan=True)
    # The reference wrote exactly the non-negative slots, with the right values.
    flat_k = k_ref.reshape(-1, heads, head_dim)
    written = ~torch.isnan(flat_k).any(dim=(1, 2))
    expected = torch.zeros_like(written)
    expected[slots[slots >= 0]] = True
    assert torch.equal(written, expected)
    keep = slots >= 0
    torch.testing.assert_close(flat_k[slots[keep]], key[keep], rtol=0, atol=0)
    torch.testing.assert_close(v_ref.reshape(-1, heads, head_dim)[slots[keep]], value[keep], rtol=0, atol=0)


def test_store_kv_all_padding_and_empty():
    k, v = _caches(2, 16, 1, 16, torch.float32)
    key = torch.randn(3, 1, 16, device=DEVICE)
    store_kv(key, key, k, v, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    assert torch.isnan(k).all() and torch.isnan(v).all()
    empty = key[:0]
    store_kv(empty, empty, k, v, torch.empty(0, dtype=torch.int64, device=DEVICE))
    store_kv_reference(empty, empty, k, v, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.isnan(k).all()


@pytest.mark.parametrize("fn", [store_kv, store_kv_reference])
def test_store_kv_rejects_bad_inputs(fn):
    k, v = _caches(2, 16, 2, 16, torch.float32)
    key = torch.randn(3, 2, 16, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        fn(key, key, k, v, slots.int())
    with pytest.raises(ValueError, match="key must be"):
        fn(key[:, :1], key[:, :1], k, v, slots)
    with pytest.raises(ValueError, match="dtype"):
        fn(key.half(), key.half(), k, v, slots)
    with pytest.raises(ValueError, match="v_cache"):
        fn(key, key, k, v[:1], slots)
