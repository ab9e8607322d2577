"""Linear layers with weights reordered once for oneDNN: the CPU engine's matmuls.

`nn.Linear` on CPU hands a [out, in] weight to MKL (float32) or oneDNN (bfloat16) at every call, and oneDNN
reorders it into its blocked layout each time. `PackedLinear` keeps the weight in the blocked layout that oneDNN
chooses for the expected number of rows (`torch.ops.mkldnn._reorder_linear_weight`, the op Inductor's CPU weight
prepacking uses when it freezes a graph) and multiplies with `torch.ops.mkldnn._linear_pointwise`. Measured on
this project's 2-core machines in docs/benchmarks.md ("CPU matmuls"). The reordered weight replaces the plain one:
no second copy stays in memory, except for a tied output head, whose embedding table the input side still reads
by row.
"""

from __future__ import annotations

import torch
from torch import nn


def packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack `dtype` weights here: this torch has the linear reorder ops, and for bfloat16 /
    float16 the CPU has what oneDNN's low-precision kernels need (the reorder raises otherwise; Inductor's weight
    prepacking checks the same `_is_mkldnn_*_supported`)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """y = x @ weight.T (+ bias) with `weight` in oneDNN's blocked layout.

    Args:
        weight: [out_features, in_features], float32 or bfloat16, on the CPU.
        bias: [out_features] or None, same dtype.
        expected_rows: rows of x the layout is chosen for (the engine's decode batch, max_num_seqs); any row
            count works.

    forward: x [N, in_features] (weight's dtype) -> [N, out_features].
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, expected_rows: int):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), expected_rows)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
