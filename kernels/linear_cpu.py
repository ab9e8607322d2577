"""Linear layers for CPUs: C++ kernels for ``y = x @ W.T (+ bias) (+ y)`` with W packed once into column panels,
in float32 or, where the CPU has AVX512-BF16, as bfloat16 (x rounded to bfloat16 too, products summed in float32)
(``linear_cpu.cpp``), or as weight-only int8 (8-bit codes with a float32 scale and minimum per group of 32 inputs
of a row, ``linear_int8.cpp``), built on first use (``kernels/cpu_library.py``) and called through ctypes.

Why: the CPU engine's decode steps multiply at most max_num_seqs rows (1-32) by each weight. oneDNN's packed
float32 path and MKL reach a fraction of one core's FMA rate there, and a batch-1 step is bound by reading the
weights (540 MB in float32 for SmolLM2-135M); int8 codes and their group parameters read 0.31 of that. Measured
in docs/benchmarks.md ("The CPU step"); the kernels' schemes are in the .cpp files.

Contract (``CpuLinearKernels.linear``): x float32 ``[M, K]`` on the CPU with unit stride in K; the weight packed by
``pack``; bias float32 ``[N]`` or None; out float32 ``[M, N]`` with unit stride in N (allocated when None). With
``accumulate`` the product is added to ``out``'s values (a fused residual add). Each output is one fp32 sum in k
order (int8 without VNNI: of ``x * w``, w = q * s + m dequantized in float32; bfloat16: of ``bf16(x) * bf16(W)``, two
products per step, vdpbf16ps's rounding), or for int8 with VNNI (``int8_kernel``) exact integer sums per group of 32
of the codes times x quantized per row and group to 15 bits (c = round(x * 16256 / max|x|)), each group's sum
scaled and added in float32 in group order; then the bias, whatever the number of rows: a row's result does not
depend on the rest of the batch. Threads: the work is split over the calling thread's OpenMP team (torch's), with
the GIL released.

int8 quantisation (``pack(weight, "int8")``): asymmetric, per group of ``INT8_GROUP`` = 32 consecutive inputs of
an output row (the last group of a row may be shorter): ``q = round((W - m) / s)`` (round half to even) in
[0, 255], stored as uint8, on whichever of two grids has the smaller largest error over the group (min/max on a
tie): min/max, ``m = min W``, ``s = (max W - m) / 255``, or centred, ``s = max |W| / 127``, ``m = -128 s``; a group
of equal weights gets s = 0. The weight the FMA kernel multiplies is ``q * s + m`` in float32 (one rounding where
the CPU fuses multiply-adds), which ``dequantize`` gives; the VNNI kernels never form it (they scale each group's
integer sum of q times the quantized x by s and add m times the sum of x's codes), and ``q * s + m`` is the weight
their result approximates the product with. A GGUF Q4_1 block of 32 (``d * q4 + m``, q4 in 0..15) comes back as
q = 17 * q4 on the first grid, a Q8_0 block (``d * q8``) as q = q8 + 128 on the second, so a checkpoint dequantized
from them (SmolLM2's) keeps its weights up to float32 rounding (see the .cpp).

bfloat16 (``pack(weight, "bfloat16")``, only where ``bf16_kernel`` is not None): W rounded to nearest even, as
``weight.to(torch.bfloat16)``; x is rounded the same way inside each call. The panels hold pairs of consecutive k
(``[ceil(N / NR), P, NR, 2]``, P = ceil(K / 2) rounded up to a multiple of 16, zero-padded), the operand layout of
AVX512-BF16's ``vdpbf16ps`` and of AMX's ``tdpbf16ps``; AMX runs them where the CPU has it, else vdpbf16ps or,
where that runs at under 2/3 of the FMA rate, FMAs on the pairs widened to float32 (see the .cpp for why and how).
Rounding: each product of two bf16 is exact in float32, the sums round to nearest even (vdpbf16ps and AMX flush
denormals to zero).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cpu_library import (
    CpuKernelUnavailable,
    CpuLibrary,
    check_cpu_tensor,
    check_disjoint,
    check_float32_rows,
    load_functions,
)

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math",
          "-shared", "-fPIC", "-std=c++17"]
WEIGHT_FORMATS = ("float32", "int8", "bfloat16")
INT8_GROUP = 32  # inputs per int8 scale and minimum (linear_int8.cpp's GROUP)
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_SIGNATURES = {
    "linear_panel_width": ([], _I64),
    "linear_bf16_kernel": ([], _I64),
    "linear_bf16_pairs": ([_I64], _I64),
    "linear_pack_bf16": ([_PTR, _I64, _I64, _I64, _PTR], None),
    "linear_bf16": ([_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64], None),
    "linear_pack_f32": ([_PTR, _I64, _I64, _I64, _PTR], None),
    "linear_f32": ([_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64], None),
}
_INT8_SOURCE = Path(__file__).with_name("linear_int8.cpp")
_INT8_SIGNATURES = {
    "linear_i8_group": ([], _I64),
    "linear_i8_panel_width": ([], _I64),
    "linear_i8_k_interleave": ([], _I64),
    "linear_i8_kernel": ([], _I64),
    "linear_pack_i8": ([_PTR, _I64, _I64, _I64, _PTR, _PTR], None),
    "linear_i8": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64], None),
}


@dataclass(frozen=True)
class PackedWeight:
    """A ``[out_features, in_features]`` weight in the kernel's layout.

    Attributes:
        panels: ``[ceil(out_features / NR), in_features, NR]`` float32 (NR: the kernel's panel width); uint8
            int8 codes ``[ceil(out_features / NR), K', NR]``, per panel ``[K'][NR]`` (K' = in_features) for the
            FMA int8 kernel or ``[K' / 4][NR][4]`` (K' = in_features rounded up to 4) for the VNNI ones; or
            ``[ceil(out_features / NR), P, NR, 2]`` bfloat16 (P pairs of k, see the module docstring); zero-padded.
        scales: the int8 codes' ``[ceil(out_features / NR), ceil(in_features / 32), 2, NR]`` float32 group
            parameters (per panel and group of 32 inputs: the scales, then the minimums, of the panel's columns);
            None for float32 and bfloat16.
        k_interleave: int8: the consecutive inputs of a channel stored together (1: FMA layout, 4: VNNI layout),
            which the shapes alone cannot tell apart when in_features is a multiple of 4; 1 for the others.
    """

    panels: torch.Tensor
    scales: torch.Tensor | None
    out_features: int
    in_features: int
    k_interleave: int = 1

    @property
    def format(self) -> str:
        """"int8", "bfloat16" or "float32", from the panels' dtype."""
        return {torch.uint8: "int8", torch.bfloat16: "bfloat16"}.get(self.panels.dtype, "float32")

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight (panels and scales)."""
        scales = 0 if self.scales is None else self.scales.numel() * 4
        return self.panels.numel() * self.panels.element_size() + scales


class CpuLinearKernels(CpuLibrary):
    """The built kernel library (`kernels.cpu_library.CpuLibrary`: built in ``build_dir`` on first use).

    Attributes:
        panel_width: NR, the output channels per packed panel (16 with AVX2, 32 with AVX-512, 8 portable).
        bf16_kernel: what runs the bfloat16 panels here: "amx" (AMX tiles: the CPU has AMX-BF16 and Linux granted
            the process its tile state), "avx512_bf16" (vdpbf16ps), "avx512_fma" (each pair widened to float32,
            FMAs: chosen without AMX where the FMA loop runs at least 1.5x vdpbf16ps's FLOP rate, measured once per
            process) or None (this CPU, or build, has none of them).
        int8_kernel: (a property: the first int8 use builds linear_int8.cpp) what runs the int8 codes:
            "avx512_vnni" or "avx_vnni" (integer dot products, activations quantized to 15 bits per group of 32,
            see linear_int8.cpp) or "fma" (weights dequantized to float32, FMAs: CPUs without VNNI).

    Raises:
        kernels.cpu_library.CpuKernelUnavailable: the kernel cannot be built or loaded here (the message says why).
    """

    SOURCE = Path(__file__).with_name("linear_cpu.cpp")
    FLAGS = _FLAGS
    SIGNATURES = _SIGNATURES

    def __init__(self, build_dir: str | os.PathLike):
        super().__init__(build_dir)
        self._build_dir, self._flags = Path(build_dir), list(self.FLAGS)  # the int8 library's, built later
        self._int8_interleave = 0  # linear_i8_k_interleave(), once the int8 kernels are loaded
        self.panel_width = int(self._fn["linear_panel_width"]())
        self.bf16_kernel = {2: "amx", 1: "avx512_bf16", 3: "avx512_fma"}.get(int(self._fn["linear_bf16_kernel"]()))

    def _load_int8(self) -> None:
        """Load the int8 kernels, their own library (linear_int8.cpp), on first int8 use, so that a build failure
        there leaves float32 and bfloat16 working; their entry points join this library's.

        Raises:
            CpuKernelUnavailable: linear_int8.cpp cannot be built or loaded, or disagrees with this wrapper.
        """
        if self._int8_interleave:
            return
        functions = load_functions(_INT8_SOURCE, self._build_dir, self._flags, _INT8_SIGNATURES)[1]
        layout = (functions["linear_i8_group"](), functions["linear_i8_panel_width"]())
        if layout != (INT8_GROUP, self.panel_width):
            raise CpuKernelUnavailable(f"{_INT8_SOURCE.name} has groups and panels of {layout}, this wrapper "
                                       f"{(INT8_GROUP, self.panel_width)}")
        self._fn.update(functions)
        self._int8_interleave = int(functions["linear_i8_k_interleave"]())

    def entry_point(self, name: str):
        """As `CpuLibrary.entry_point`; the int8 ones load linear_int8.cpp first (`_load_int8`)."""
        if name in _INT8_SIGNATURES:
            self._load_int8()
        return super().entry_point(name)

    @property
    def int8_kernel(self) -> str:
        """What runs the int8 codes (see the class docstring); loads the int8 kernels."""
        return {0: "fma", 1: "avx512_vnni", 2: "avx_vnni"}[int(self.entry_point("linear_i8_kernel")())]

    def _int8_params_shape(self, n: int, k: int) -> tuple[int, ...]:
        return (-(-n // self.panel_width), -(-k // INT8_GROUP), 2, self.panel_width)

    def _shape(self, weight_format: str, n: int, k: int) -> tuple[int, ...]:
        if weight_format == "bfloat16":
            return (-(-n // self.panel_width), int(self._fn["linear_bf16_pairs"](k)), self.panel_width, 2)
        if weight_format == "int8":
            self._load_int8()
            return (-(-n // self.panel_width), -(-k // self._int8_interleave) * self._int8_interleave,
                    self.panel_width)
        return (-(-n // self.panel_width), k, self.panel_width)

    def pack(self, weight: torch.Tensor, weight_format: str) -> PackedWeight:
        """Pack a float32 ``[N, K]`` CPU weight as "float32", "int8" or "bfloat16" panels (see the module
        docstring).

        Raises:
            ValueError: an unknown format, or a weight that is not a float32 CPU matrix with unit stride in K.
            kernels.cpu_library.CpuKernelUnavailable: "bfloat16" where this build has no bfloat16 panels, "int8"
                where the int8 kernels cannot be built or loaded.
        """
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
        check_float32_rows("weight", weight)
        n, k = weight.shape
        shape = self._shape(weight_format, n, k)
        if weight_format == "bfloat16":
            if self.bf16_kernel is None:
                raise CpuKernelUnavailable("bfloat16 panels need AVX512-BF16, which this CPU (or build) lacks")
            panels = torch.empty(shape, dtype=torch.bfloat16)
            self._fn["linear_pack_bf16"](weight.data_ptr(), n, k, weight.stride(0), panels.data_ptr())
            return PackedWeight(panels, None, n, k)
        if weight_format == "float32":
            panels = torch.empty(shape, dtype=torch.float32)
            self._fn["linear_pack_f32"](weight.data_ptr(), n, k, weight.stride(0), panels.data_ptr())
            return PackedWeight(panels, None, n, k)
        panels = torch.empty(shape, dtype=torch.uint8)
        scales = torch.empty(self._int8_params_shape(n, k), dtype=torch.float32)
        self.entry_point("linear_pack_i8")(weight.data_ptr(), n, k, weight.stride(0), panels.data_ptr(),
                                           scales.data_ptr())
        return PackedWeight(panels, scales, n, k, self._int8_interleave)

    def check_packed(self, packed: PackedWeight) -> None:
        """Raise ValueError unless `packed` is laid out as this library packs: contiguous CPU panels of its panel
        width covering the weight's shape, float32 or bfloat16 without scales or uint8 int8 codes with their float32
        group parameters (a weight packed by a build with another panel width would be read past its end);
        bfloat16 only where this build has it."""
        if packed.panels.dtype not in (torch.float32, torch.uint8, torch.bfloat16):
            raise ValueError(f"packed panels must be float32, uint8 (int8 codes) or bfloat16, got "
                             f"{packed.panels.dtype}")
        if packed.panels.dtype == torch.bfloat16 and self.bf16_kernel is None:
            raise ValueError("bfloat16 panels need a build with AVX512-BF16, which this one lacks")
        shape = self._shape(packed.format, packed.out_features, packed.in_features)
        check_cpu_tensor("packed panels", packed.panels, packed.panels.dtype, shape)
        if packed.panels.dtype == torch.uint8:
            if packed.scales is None:
                raise ValueError("int8 panels need their group scales and minimums")
            check_cpu_tensor("scales", packed.scales, torch.float32,
                             self._int8_params_shape(packed.out_features, packed.in_features))
            if packed.k_interleave != self._int8_interleave:
                raise ValueError(f"int8 panels with {packed.k_interleave} inputs to a lane, this build's kernel "
                                 f"({self.int8_kernel}) takes {self._int8_interleave}: pack the weight here")
        elif packed.scales is not None:
            raise ValueError(f"{packed.format} panels take no scales")

    def dequantize(self, packed: PackedWeight) -> torch.Tensor:
        """The float32 ``[N, K]`` weight the packed panels stand for (for int8: ``q * s + m`` rounded once, as the
        FMA kernel's fused multiply-add gives it; for bfloat16 the rounded weight, exactly)."""
        n, k = packed.out_features, packed.in_features
        if packed.panels.dim() == 4:  # bfloat16 pairs: [panels, k / 2, NR, 2] -> [panels * NR, k / 2 * 2]
            return packed.panels.permute(0, 2, 1, 3).reshape(-1, packed.panels.shape[1] * 2)[:n, :k].float()
        if packed.scales is None:
            return packed.panels.permute(0, 2, 1).reshape(-1, k)[:n].float()
        weight = self.int8_codes(packed).float()
        # [panels, groups, 2, NR] -> per row and input: scale, minimum; q * s is exact in float64 (8 + 24
        # significant bits), so rounding q * s + m to float32 from there is the fused multiply-add's one rounding
        # but where the float64 sum itself rounded onto a float32 tie
        params = packed.scales.permute(0, 3, 1, 2).reshape(-1, packed.scales.shape[1], 2)[:n].double()
        params = params.repeat_interleave(INT8_GROUP, dim=1)[:, :k]
        return (weight.double() * params[..., 0] + params[..., 1]).float()

    def int8_codes(self, packed: PackedWeight) -> torch.Tensor:
        """The int8 weight's codes as a uint8 ``[N, K]`` matrix, read from the packed panels' layout."""
        panels, kq = packed.panels, packed.k_interleave
        codes = panels.view(panels.shape[0], panels.shape[1] // kq, self.panel_width, kq).permute(0, 2, 1, 3)
        return codes.reshape(-1, panels.shape[1])[: packed.out_features, : packed.in_features]

    def linear(self, x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        """``out (+)= x @ W.T + bias``; returns out ``[M, N]`` float32 (see the module docstring).

        Raises:
            ValueError: shapes, dtypes, devices or strides outside the contract, or accumulate without out.
        """
        check_float32_rows("x", x)
        m, k = x.shape
        n = packed.out_features
        if k != packed.in_features:
            raise ValueError(f"x has {k} features, the weight takes {packed.in_features}")
        self.check_packed(packed)
        if bias is not None:
            check_cpu_tensor("bias", bias, torch.float32, (n,))
        if out is None:
            if accumulate:
                raise ValueError("accumulate needs out (the values to add to)")
            out = torch.empty((m, n), dtype=torch.float32)
        else:
            check_float32_rows("out", out)
            if out.shape != (m, n):
                raise ValueError(f"out must have shape ({m}, {n}), got {tuple(out.shape)}")
            check_disjoint("out", out, "x", x)
        if m == 0:
            return out
        bias_ptr = None if bias is None else bias.data_ptr()
        if packed.panels.dtype == torch.bfloat16:
            self._fn["linear_bf16"](x.data_ptr(), m, k, x.stride(0), packed.panels.data_ptr(), n, bias_ptr,
                                    out.data_ptr(), out.stride(0), int(accumulate))
        elif packed.scales is None:
            self._fn["linear_f32"](x.data_ptr(), m, k, x.stride(0), packed.panels.data_ptr(), n, bias_ptr,
                                   out.data_ptr(), out.stride(0), int(accumulate))
        else:
            self.entry_point("linear_i8")(x.data_ptr(), m, k, x.stride(0), packed.panels.data_ptr(),
                                          packed.scales.data_ptr(), n, bias_ptr, out.data_ptr(), out.stride(0),
                                          int(accumulate))
        return out

