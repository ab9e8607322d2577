"""oneDNN-packed linear layers (omni_backend/engine/cpu_linear.py) against torch's `nn.functional.linear`."""

from __future__ import annotations

import pytest
import torch

from omni_backend.engine import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.packing_available(torch.float32),
                                reason="this torch has no oneDNN linear reorder")

# float32: oneDNN and MKL sum the 576/1536 products in other orders (about 1e-6 relative each);
# bfloat16: both are oneDNN with float32 accumulation and one rounding of the output, so equal.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=0, rtol=0)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 32, 33])
@pytest.mark.parametrize("in_features,out_features,bias", [(576, 960, True), (1536, 576, False)])
def test_packed_linear_equals_linear(dtype, rows, in_features, out_features, bias):
    if not cpu_linear.packing_available(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU (the engine keeps nn.Linear then)")
    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    packed = cpu_linear.PackedLinear(linear.weight, linear.bias, expected_rows=32)
    with torch.no_grad():
        want = linear(x)
        got = packed(x)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def test_packed_linear_keeps_no_plain_weight():
    packed = cpu_linear.PackedLinear(torch.randn(32, 64), None, expected_rows=8)
    assert [name for name, _ in packed.named_parameters()] == []
    assert packed.packed_weight.numel() >= 64 * 32


def test_packing_is_refused_for_dtypes_onednn_cannot_run(monkeypatch):
    """bfloat16 needs oneDNN's bf16 support on this CPU (the reorder raises without it): no packing then."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not cpu_linear.packing_available(torch.bfloat16)
    assert cpu_linear.packing_available(torch.float32)
