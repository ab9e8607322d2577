"""The C++ float32 elementwise ops of the CPU engine against the torch code they replace: RoPE + the K/V cache
write (float32 or bfloat16 caches) bit for bit, RMSNorm and SiLU * up within a few float32 roundings."""

import math
import os
import shutil
import subprocess

import pytest
import torch

from kernels.cpu_ops import CpuOps
from kernels.store_kv import store_kv_reference
from omni_backend.engine.models.llama import RMSNorm
from omni_backend.engine.models.rope import apply_rope, cos_sin_cache

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    return CpuOps(tmp_path_factory.mktemp("cpu_ops"))


@pytest.mark.parametrize("m,h", [(1, 576), (7, 64), (33, 100)])
def test_rms_norm_matches_the_torch_module(ops, m, h):
    gen = torch.Generator().manual_seed(m + h)
    wide = torch.randn(m, h + 5, generator=gen) * 3
    x = wide[:, 2 : 2 + h]  # strided rows
    norm = RMSNorm(h, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(h, generator=gen))
        want = norm(x)
    got = ops.rms_norm(x, norm.weight.detach(), 1e-5)
    # the two differ in the order of the sum of squares: a relative error of a few units of 2^-24 in the scale
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (2, 1, 128)])
def test_rope_and_cache_write_equal_the_torch_path_bit_for_bit(ops, num_q_heads, num_kv_heads, head_dim, cache_dtype):
    """bfloat16 caches: the float32 K/V rounded to nearest even, as torch's assignment into a bfloat16 tensor."""
    gen = torch.Generator().manual_seed(head_dim)
    tokens, num_blocks, block_size = 11, 6, 4
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(tokens, width + 3, generator=gen)[:, :width]  # rows of stride width + 3
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[3] = -1  # padding: rotated, not stored
    cos, sin = cos_sin_cache(head_dim, 512, {"rope_type": "default", "rope_theta": 10000.0})
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn_like(k_cache)

    heads = qkv.reshape(tokens, -1, head_dim)
    want_qk = apply_rope(heads[:, : num_q_heads + num_kv_heads], cos[positions], sin[positions])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv_reference(want_qk[:, num_q_heads:].to(cache_dtype), heads[:, num_q_heads + num_kv_heads :].to(cache_dtype),
                       want_k, want_v, slots)

    ops.rope_store_kv(qkv, num_q_heads, num_kv_heads, positions, cos, sin, slots, k_cache, v_cache)
    got = qkv.reshape(tokens, -1, head_dim)
    assert torch.equal(got[:, : num_q_heads + num_kv_heads], want_qk)
    assert torch.equal(got[:, num_q_heads + num_kv_heads :], heads[:, num_q_heads + num_kv_heads :])
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_rope_store_kv_refuses_positions_and_slots_out_of_range(ops):
    qkv = torch.randn(3, 3 * 8)
    cos, sin = torch.ones(16, 8), torch.zeros(16, 8)
    cache = torch.zeros(2, 4, 1, 8)
    for positions, slots, bad in (([0, 16, 1], [0, 1, 2], 1), ([0, 1, 2], [0, 8, 2], 1), ([-1, 0, 0], [0, 1, 2], 0)):
        before = qkv.clone()
        with pytest.raises(ValueError, match=f"row {bad}: position"):
            ops.rope_store_kv(qkv, 1, 1, torch.tensor(positions), cos, sin, torch.tensor(slots), cache, cache.clone())
        assert torch.equal(qkv[bad], before[bad]), "the refused row is left as it was"
    with pytest.raises(ValueError, match="does not hold"):
        ops.rope_store_kv(torch.randn(3, 20), 1, 1, torch.zeros(3, dtype=torch.int64), cos, sin,
                          torch.zeros(3, dtype=torch.int64), cache, cache.clone())
    zeros = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="positions must be"):
        ops.rope_store_kv(qkv, 1, 1, torch.zeros(3, dtype=torch.int32), cos, sin, zeros, cache, cache.clone())
    with pytest.raises(ValueError, match="slot_mapping must be a contiguous torch.int64 CPU"):
        ops.rope_store_kv(qkv, 1, 1, zeros, cos, sin, zeros.to("meta"), cache, cache.clone())
    with pytest.raises(ValueError, match=r"sin must be .* of shape \(16, 8\)"):  # a shorter table would be overrun
        ops.rope_store_kv(qkv, 1, 1, zeros, cos, sin[:8], zeros, cache, cache.clone())
    # -2 query heads + 2 x 2 KV heads of 8 match a width of 16: without the head check the kernel read before qkv
    two_kv = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="num_q_heads and num_kv_heads must be at least 1, got -2, 2"):
        ops.rope_store_kv(torch.randn(3, 16), -2, 2, zeros, cos, sin, zeros, two_kv, two_kv.clone())
    with pytest.raises(ValueError, match="must be at least 1, got 0, 1"):
        ops.rope_store_kv(torch.randn(3, 16), 0, 1, zeros, cos, sin, zeros, cache, cache.clone())
    odd = torch.zeros(2, 4, 1, 7)
    with pytest.raises(ValueError, match="head_dim must be even"):
        ops.rope_store_kv(torch.randn(3, 21), 1, 1, zeros, torch.ones(16, 7), torch.zeros(16, 7), zeros, odd,
                          odd.clone())
    with pytest.raises(ValueError, match="weight must be a contiguous torch.float32 CPU"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(8, device="meta"), 1e-5)


def test_silu_mul_matches_torch_over_the_whole_range(ops):
    gen = torch.Generator().manual_seed(5)
    gate = torch.cat([torch.randn(4, 100, generator=gen) * 4, torch.linspace(-120, 120, 400).view(4, 100)], dim=1)
    up = torch.randn(4, 200, generator=gen)
    got = ops.silu_mul(torch.cat([gate, up], dim=1))
    want = torch.nn.functional.silu(gate.double()) * up.double()
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-30)
    with pytest.raises(ValueError, match="even width"):
        ops.silu_mul(torch.randn(2, 5))


def test_silu_mul_of_nan_and_infinite_gates_is_torchs(ops):
    """NaN and infinite gates reach exp_nonpositive with NaN / -inf: the results are torch's (NaN, NaN, +-inf)."""
    gate = torch.tensor([[float("nan"), float("-inf"), float("inf"), -3.0]])
    up = torch.tensor([[2.0, 2.0, -2.0, 2.0]])
    got = ops.silu_mul(torch.cat([gate, up], dim=1))
    want = torch.nn.functional.silu(gate) * up
    assert torch.isnan(got[0, :2]).all() and got[0, 2] == float("-inf")
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-6, atol=0.0)


EXP_PROBE = r"""
#include <cmath>
#include <cstdio>
#include "cpu_math.h"
int main() {
  const float inputs[] = {NAN, -INFINITY, INFINITY, -1000.0f, -87.5f, -87.0f, -10.0f, -1.0f, -0.0f, 0.0f, 3.0f};
  for (float x : inputs) std::printf("%.9g\n", omni::exp_nonpositive(x));
  return 0;
}
"""


def test_exp_nonpositive_is_defined_for_nan_and_infinities(tmp_path):
    """cpu_math.h's exp built with UBSan (float-to-int casts and shifts checked, any report fatal): NaN gives NaN,
    -inf and everything below -87 give 0, the contract's range matches exp, and x > 0 gives 1 (documented)."""
    source = tmp_path / "exp_probe.cpp"
    source.write_text(EXP_PROBE)
    binary = tmp_path / "exp_probe"
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    kernels_dir = os.path.dirname(os.path.abspath(CpuOps.SOURCE))
    subprocess.run([compiler, "-O2", "-std=c++17", "-fsanitize=undefined,float-cast-overflow",
                    "-fno-sanitize-recover=all", "-I", kernels_dir, str(source), "-o", str(binary)], check=True,
                   capture_output=True, timeout=120)
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and "runtime error" not in run.stderr, run.stderr
    got = [float(line) for line in run.stdout.split()]
    assert math.isnan(got[0])
    assert got[1:5] == [0.0, 1.0, 0.0, 0.0]  # -inf, +inf (outside the contract: 1), -1000, -87.5
    for x, value in zip([-87.0, -10.0, -1.0, -0.0, 0.0], got[5:10]):
        assert value == pytest.approx(math.exp(x), rel=3e-7), x
    assert got[10] == 1.0
