"""The C++ CPU linear kernels (float32 panels, weight-only int8 codes with group scales and minimums, bfloat16
panels) against float64 matrix products, with the
rounding-error bound of a float32 sum of K products (Higham, "Accuracy and Stability of Numerical Algorithms",
2nd ed., section 3.1: |error| <= gamma_K * sum_k |x_k w_k|, gamma_K = K u / (1 - K u), u = 2^-24). The int8 VNNI
kernels quantize x to 15 bits per group of 32: against a float64 model of that quantization, with the bound of
their per-group float32 roundings, and against the float64 product within the quantization's half step."""

import os
import platform
import shutil

import pytest
import torch

from kernels import linear_cpu
from kernels.cpu_library import CpuKernelUnavailable, cpu_features
from kernels.linear_cpu import INT8_GROUP, CpuLinearKernels, PackedWeight

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")

X86 = platform.machine() in ("x86_64", "AMD64", "i686")
UNIT_ROUNDOFF = 2.0 ** -24


# builds besides the native one: without AVX2/AVX-512 (the generic vector code that CPUs without them, and Arm,
# run; int8 on FMAs) and, on CPUs with AVX-VNNI, without AVX-512 (AVX2 tiles, the 256-bit VNNI int8 kernel)
EXTRA_BUILDS = {"portable": ["-mno-avx2", "-mno-avx512f"], "avx_vnni": ["-mno-avx512f"]}


@pytest.fixture(scope="module", params=["native", *EXTRA_BUILDS])
def kernels(request, tmp_path_factory):
    """The kernel as the engine builds it, and the EXTRA_BUILDS where this CPU can run them."""
    if request.param != "native":
        if not X86:
            pytest.skip("the other builds are x86 variants")
        if request.param == "avx_vnni" and "avx_vnni" not in cpu_features().split():
            pytest.skip("this CPU has no AVX-VNNI")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(CpuLinearKernels, "FLAGS", CpuLinearKernels.FLAGS + EXTRA_BUILDS[request.param])
            built = CpuLinearKernels(tmp_path_factory.mktemp(f"linear_{request.param}"))
    else:
        built = CpuLinearKernels(tmp_path_factory.mktemp("linear"))
    built.build = request.param
    return built


def test_int8_kernel_is_the_cpus(kernels):
    flags = set(cpu_features().split())
    native = "avx512_vnni" if {"avx512_vnni", "avx512bw"} <= flags else "avx_vnni" if "avx_vnni" in flags else "fma"
    assert kernels.int8_kernel == {"native": native, "portable": "fma", "avx_vnni": "avx_vnni"}[kernels.build]


def _bound(x: torch.Tensor, w: torch.Tensor, extra_roundings: int = 0) -> torch.Tensor:
    """Per-output bound on the float32 error of x @ w.T (+ a few more roundings: bias, scale, accumulate)."""
    k = x.shape[1] + extra_roundings
    gamma = k * UNIT_ROUNDOFF / (1 - k * UNIT_ROUNDOFF)
    return gamma * (x.double().abs() @ w.double().abs().T) + 1e-30


def _assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    error = (got.double() - want).abs()
    assert bool((error <= bound).all()), f"max error {error.max():.3e}, worst error/bound {(error / bound).max():.3f}"


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 12, 13, 32, 33, 100])
@pytest.mark.parametrize("n,k", [(1, 1), (17, 7), (48, 64), (100, 576)])
def test_float32_panels_match_float64(kernels, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, bias = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = kernels.pack(w, "float32")
    assert packed.panels.shape == (-(-n // kernels.panel_width), k, kernels.panel_width)
    assert torch.equal(kernels.dequantize(packed), w)
    _assert_within(kernels.linear(x, packed), x.double() @ w.double().T, _bound(x, w))
    _assert_within(kernels.linear(x, packed, bias), x.double() @ w.double().T + bias.double(),
                   _bound(x, w, 1) + bias.double().abs() * UNIT_ROUNDOFF)


def _group_params(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 weight's scale s and minimum m per output and group, [N, G] float32 each."""
    params = packed.scales.permute(0, 3, 1, 2).reshape(-1, packed.scales.shape[1], 2)[: packed.out_features]
    return params[..., 0], params[..., 1]


def _codes_and_params(kernels, packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 weight's codes q [N, K] and per-input scale s and minimum m [N, K] (float32), read from its layout."""
    k = packed.in_features
    scale, low = (p.repeat_interleave(INT8_GROUP, dim=1)[:, :k] for p in _group_params(packed))
    return kernels.int8_codes(packed).float(), scale, low


VNNI_TOP = 16256  # int8_vnni.h's TOP: 127 * 128, the largest 15-bit activation code
VNNI_SMALLEST = 2.0 ** -100  # int8_vnni.h's SMALLEST: a group with max|x| below counts as zero
# |x - c s_a| in quantization steps s_a: half a step, plus the float32 roundings of 16256 / max|x|, of x times it
# (each relative 2^-24 of a value up to 16256 steps) and of s_a
STEP_SLACK = 0.5 + 3 * VNNI_TOP * UNIT_ROUNDOFF


def _quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the VNNI kernels quantize it: codes c [M, G, 32] (float64, zero past K) and scales s_a [M, G]
    (float64 of the float32 values): c = round_half_even(fl32(x * fl32(16256 / max|x|))), s_a = fl32(max|x| / 16256)
    per row and group of 32; a group with max|x| < 2^-100 gets c = 0 and s_a = 0."""
    m, k = x.shape
    groups = -(-k // INT8_GROUP)
    padded = torch.nn.functional.pad(x, (0, groups * INT8_GROUP - k)).view(m, groups, INT8_GROUP)
    top = padded.abs().amax(-1, keepdim=True)
    # tensor by tensor: torch divides by a Python number as a multiplication by its reciprocal (not IEEE division)
    full_top = torch.full_like(top, VNNI_TOP)
    kept = top >= VNNI_SMALLEST
    inv = torch.where(kept, full_top / top.clamp(min=VNNI_SMALLEST), torch.zeros_like(top))
    codes = torch.round(padded * inv).clamp(-VNNI_TOP, VNNI_TOP)
    return codes.double(), torch.where(kept, top / full_top, torch.zeros_like(top))[..., 0].double()


def _int8_product(kernels, x: torch.Tensor, packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """What this build's int8 kernel computes for x @ W.T in float64, and the bound on its float32 rounding error.
    FMA kernel: x @ deq.T, a float32 sum of K + 1 roundings (each weight dequantized once). VNNI kernels:
    sum_g s_a (s_w dot_g + m_w sum_g c) with dot_g = sum q c exact; per group the roundings of dot to float32, of
    s_w dot, m_w sum c, their sum, the product with s_a, and the accumulation over G groups: gamma_(G+5) times
    sum_g |s_a| (|s_w dot_g| + |m_w sum_g c|)."""
    deq = kernels.dequantize(packed)
    if kernels.int8_kernel == "fma":
        return x.double() @ deq.double().T, _bound(x, deq, 1)
    codes, s_a = _quantized_activations(x)
    groups = codes.shape[1]
    q = torch.nn.functional.pad(kernels.int8_codes(packed).double(), (0, groups * INT8_GROUP - x.shape[1]))
    dot = torch.einsum("mgk,ngk->mng", codes, q.view(q.shape[0], groups, INT8_GROUP))
    s_w, m_w = (p.double() for p in _group_params(packed))
    sums = codes.sum(-1)[:, None, :]
    want = (s_a[:, None, :] * (s_w * dot + m_w * sums)).sum(-1)
    gamma = (groups + 5) * UNIT_ROUNDOFF / (1 - (groups + 5) * UNIT_ROUNDOFF)
    magnitude = (s_a[:, None, :] * ((s_w * dot).abs() + (m_w * sums).abs())).sum(-1)
    return want, gamma * magnitude + 1e-30


def _assert_int8_product(kernels, got: torch.Tensor, x: torch.Tensor, packed: PackedWeight) -> None:
    """got = x @ W.T by this build's int8 kernel: within its rounding bound of what it computes and, for VNNI, of
    the float64 product of x and the dequantized weights within the activations' quantization error (STEP_SLACK
    steps s_a each; a group flushed to zero: its own |x|)."""
    want, bound = _int8_product(kernels, x, packed)
    _assert_within(got, want, bound)
    if kernels.int8_kernel != "fma":
        k = x.shape[1]
        deq = kernels.dequantize(packed).double()
        codes, s_a = _quantized_activations(x)
        s_a = s_a.repeat_interleave(INT8_GROUP, 1)[:, :k]
        error = (codes.flatten(1)[:, :k] * s_a - x.double()).abs()
        allowed = torch.where(s_a > 0, s_a * STEP_SLACK, x.double().abs())
        assert bool((error <= allowed).all()), f"worst {(error / allowed).max():.3f} of the allowed error"
        _assert_within(got, x.double() @ deq.T, bound + allowed @ deq.abs().T)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 13, 32, 33])
@pytest.mark.parametrize("n,k", [(5, 3), (40, 64), (33, 70), (100, 576)])
def test_int8_codes_quantize_per_group_and_match_float64(kernels, m, n, k):
    """Codes and group parameters are one of the documented quantizer's two grids (k = 3 and 70: a short last
    group), each weight within half a step of its code; the kernel's product is what `_assert_int8_product` says:
    FMA kernel, within the float32-sum bound of the float64 product of the dequantized weights plus one rounding
    of each weight (q * s + m, fused or not); VNNI, within its roundings of a float64 model of its quantization."""
    gen = torch.Generator().manual_seed(7 * m + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n)[:, None] + torch.randn(n, 1, generator=gen)
    w[n // 2] = 0.5  # a row of equal weights: s = 0, every weight exactly m
    packed = kernels.pack(w, "int8")
    groups = -(-k // INT8_GROUP)
    assert packed.panels.dtype == torch.uint8 and packed.scales.shape == (-(-n // kernels.panel_width), groups, 2,
                                                                          kernels.panel_width)
    codes, scale, low = _codes_and_params(kernels, packed)
    for g in range(groups):
        block = w[:, g * INT8_GROUP : (g + 1) * INT8_GROUP]
        lo, hi, got = block.amin(1), block.amax(1), (scale[:, g * INT8_GROUP], low[:, g * INT8_GROUP])
        centred = torch.maximum(hi, -lo) / 127
        spread = (got[0] == (hi - lo) / 255) & (got[1] == lo)
        assert bool((spread | (got[0] == centred) & (got[1] == -128 * centred)).all())
    assert codes.min() >= 0 and codes.max() <= 255 and torch.equal(codes[n // 2], torch.zeros(k))
    deq = kernels.dequantize(packed)
    assert torch.equal(deq[n // 2], w[n // 2])
    assert torch.equal(deq, (codes.double() * scale.double() + low.double()).float())
    # round to nearest: |W - (q s + m)| <= s / 2, plus the roundings of (W - m) / s (in units of s) and of q s + m
    assert bool(((deq - w).abs() <= scale * (0.5 + 1e-4) + w.abs() * 4 * UNIT_ROUNDOFF).all())
    _assert_int8_product(kernels, kernels.linear(x, packed), x, packed)


def test_int8_keeps_a_q8_0_grid(kernels):
    """A GGUF Q8_0 row (blocks of 32: w = d * q8, q8 in -127..127 with |q8| = 127 used, d float16: SmolLM2's
    embedding table, its tied output head) comes back bit for bit, on the centred grid (codes q8 + 128)."""
    gen = torch.Generator().manual_seed(42)
    n, k = 37, 5 * INT8_GROUP
    q8 = torch.randint(-127, 128, (n, k), generator=gen)
    q8[:, ::INT8_GROUP] = 127 * (torch.randint(0, 2, (n, k // INT8_GROUP), generator=gen) * 2 - 1)
    d = (torch.rand(n, k // INT8_GROUP, generator=gen) * 0.01 + 1e-4).half().float()
    w = d.repeat_interleave(INT8_GROUP, 1) * q8  # exact in float32: 11 + 8 significant bits
    packed = kernels.pack(w, "int8")
    codes, scale, low = _codes_and_params(kernels, packed)
    assert torch.equal(codes, q8 + 128.0) and torch.equal(scale, d.repeat_interleave(INT8_GROUP, 1))
    assert torch.equal(low, -128 * scale)
    assert torch.equal(kernels.dequantize(packed), w)
    x = torch.randn(3, k, generator=gen)
    _assert_int8_product(kernels, kernels.linear(x, packed), x, packed)


def test_int8_keeps_a_q4_1_grid(kernels):
    """A GGUF Q4_1 row (blocks of 32: w = d * q4 + m, q4 in 0..15 with both ends used, d and m float16) comes back
    as codes 17 * q4 (the min/max grid) and its weights within a few float32 roundings of the block's largest;
    where d / 17 and m are powers of two times small integers, so that every step is exact in float32, bit for
    bit."""
    gen = torch.Generator().manual_seed(41)
    n, k = 37, 5 * INT8_GROUP
    q4 = torch.randint(0, 16, (n, k), generator=gen)
    q4[:, ::INT8_GROUP], q4[:, 1::INT8_GROUP] = 0, 15  # each block uses both ends, as Q4_1's quantizer does
    for exact in (False, True):
        if exact:
            d = 17 * 2.0 ** -torch.randint(6, 12, (n, k // INT8_GROUP), generator=gen).double()
            m = -8 * d / 17 * torch.randint(1, 60, d.shape, generator=gen)
        else:
            d = (torch.rand(n, k // INT8_GROUP, generator=gen) * 0.05).half().double()
            m = (-torch.rand(n, k // INT8_GROUP, generator=gen) * 0.4).half().double()
        w = (d.repeat_interleave(INT8_GROUP, 1) * q4 + m.repeat_interleave(INT8_GROUP, 1)).float()
        packed = kernels.pack(w, "int8")
        codes, _, _ = _codes_and_params(kernels, packed)
        assert torch.equal(codes, 17.0 * q4)
        deq = kernels.dequantize(packed)
        if exact:
            assert torch.equal(deq, w)
        else:
            # the roundings of the block's top, of s and of q * s + m: a few units in the block's largest weight
            magnitude = (m.abs() + 15 * d).repeat_interleave(INT8_GROUP, 1)
            assert bool(((deq - w).abs() <= magnitude * 4 * UNIT_ROUNDOFF).all())


def test_bias_accumulate_and_strided_rows(kernels):
    gen = torch.Generator().manual_seed(3)
    m, n, k = 9, 35, 40
    wide = torch.randn(m, k + 8, generator=gen)
    x = wide[:, 4 : 4 + k]  # rows of stride k + 8
    w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    for fmt in ("float32", "int8"):
        packed = kernels.pack(w, fmt)
        if fmt == "int8":
            product, bound = _int8_product(kernels, x, packed)
        else:
            product, bound = x.double() @ w.double().T, _bound(x, w)
        out_wide = torch.randn(m, n + 3, generator=gen)
        out = out_wide[:, :n]
        before, beyond = out.clone(), out_wide[:, n:].clone()
        kernels.linear(x, packed, bias, out=out, accumulate=True)
        # two more roundings (bias, accumulate) of the result's magnitude
        magnitude = (product.abs() + bias.double().abs() + before.double().abs()) * 2 * UNIT_ROUNDOFF
        _assert_within(out, product + bias.double() + before.double(), bound + magnitude + 1e-6)
        assert torch.equal(out_wide[:, n:], beyond), "columns beyond N untouched"
        assert kernels.linear(x[:0], packed).shape == (0, n)


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_each_row_is_the_same_whatever_the_batch(kernels, fmt):
    """Batch invariance: a row's outputs are bit for bit the same alone and at every position of batches of 2 to
    2 * MR + 1 rows (each output is one sum in k order, whichever tile and panel group computes it)."""
    gen = torch.Generator().manual_seed(11)
    n, k = 5 * kernels.panel_width + 3, 100  # full panel groups, leftover panels, a partial last panel and group
    packed = kernels.pack(torch.randn(n, k, generator=gen), fmt)
    x = torch.randn(25, k, generator=gen)
    alone = torch.cat([kernels.linear(x[i : i + 1], packed) for i in range(len(x))])
    for m in range(2, len(x) + 1):
        assert torch.equal(kernels.linear(x[:m], packed), alone[:m]), f"batch of {m}"


@pytest.mark.parametrize("magnitude", [1e-30, 1e-34, 1e-36, 1e-45])
def test_int8_tiny_activations(kernels, magnitude):
    """Inputs down to float32's subnormals: VNNI groups with max|x| >= 2^-100 (7.9e-31) are quantized as any
    other, smaller ones count as zero (16256 / max|x| would overflow below 4.8e-35), never a wrong sign or size."""
    gen = torch.Generator().manual_seed(22)
    n, k = kernels.panel_width + 3, 70
    packed = kernels.pack(torch.randn(n, k, generator=gen), "int8")
    x = torch.randn(3, k, generator=gen) * magnitude
    x[1, 40:] = torch.randn(30, generator=gen)  # a row mixing tiny groups and ordinary ones
    _assert_int8_product(kernels, kernels.linear(x, packed), x, packed)


def test_int8_panels_of_another_kernel_are_refused(kernels, tmp_path_factory):
    """The FMA layout [K][NR] and the VNNI one [K/4][NR][4] have the same shape where K is a multiple of 4, so a
    weight packed by a build with the other kernel is refused by its recorded interleave, not run as garbage."""
    if kernels.build != "native" or kernels.int8_kernel == "fma":
        pytest.skip("compared once, from a native VNNI build")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CpuLinearKernels, "FLAGS", CpuLinearKernels.FLAGS + ["-mno-avx512vnni", "-mno-avxvnni"])
        fma = CpuLinearKernels(tmp_path_factory.mktemp("linear_int8_fma"))
    w = torch.randn(40, 64)
    assert fma.int8_kernel == "fma"
    with pytest.raises(ValueError, match="int8 panels with 1 inputs to a lane, this build's kernel"):
        kernels.linear(torch.randn(2, 64), fma.pack(w, "int8"))
    with pytest.raises(ValueError, match="int8 panels with 4 inputs to a lane, this build's kernel"):
        fma.linear(torch.randn(2, 64), kernels.pack(w, "int8"))


def test_int8_non_finite_inputs_stay_in_their_row(kernels):
    """A NaN or infinity in x makes its row's outputs non-finite (the VNNI kernels: NaN, the group cannot be
    quantized), as a float32 product's would be, and leaves the other rows as they are alone."""
    gen = torch.Generator().manual_seed(21)
    n, k = kernels.panel_width + 3, 70
    packed = kernels.pack(torch.randn(n, k, generator=gen), "int8")
    x = torch.randn(6, k, generator=gen)
    x[1, 5], x[4, 69] = float("nan"), float("inf")
    got = kernels.linear(x, packed)
    assert not bool(got[[1, 4]].isfinite().any())
    for row in (0, 2, 3, 5):
        assert torch.equal(got[row], kernels.linear(x[row : row + 1], packed)[0])


def _rows_in_blocks_equal_rows_alone(kernels, fmt: str) -> None:
    """A prefill-size batch (its rows in several blocks, linear_cpu.cpp's ROW_BLOCK_BYTES: 1 MiB of x per block,
    about 170 rows at this K) gives each row bit for bit what it gives alone, and what the float64 product bounds."""
    gen = torch.Generator().manual_seed(13)
    n, k = 2 * kernels.panel_width + 5, 1537
    w, x = torch.randn(n, k, generator=gen), torch.randn(400, k, generator=gen)
    packed = kernels.pack(w, fmt)
    got = kernels.linear(x, packed)
    assert torch.equal(got, torch.cat([kernels.linear(x[i : i + 1], packed) for i in range(len(x))]))
    if fmt == "float32":
        _assert_within(got, x.double() @ w.double().T, _bound(x, w))


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_rows_in_blocks_equal_rows_alone(kernels, fmt):
    _rows_in_blocks_equal_rows_alone(kernels, fmt)


def test_contract_violations_raise(kernels):
    w = torch.randn(8, 4)
    packed = kernels.pack(w, "float32")
    with pytest.raises(ValueError, match="weight format"):
        kernels.pack(w, "int4")
    with pytest.raises(ValueError, match="weight must be a 2-D float32"):
        kernels.pack(w.double(), "float32")
    with pytest.raises(ValueError, match="x has 5 features"):
        kernels.linear(torch.randn(2, 5), packed)
    with pytest.raises(ValueError, match="x must be a 2-D float32"):
        kernels.linear(torch.randn(4, 2).T, packed)  # stride 2 along K
    with pytest.raises(ValueError, match="bias must be"):
        kernels.linear(torch.randn(2, 4), packed, bias=torch.randn(7))
    with pytest.raises(ValueError, match="out must have shape"):
        kernels.linear(torch.randn(2, 4), packed, out=torch.empty(3, 8))
    with pytest.raises(ValueError, match="accumulate needs out"):
        kernels.linear(torch.randn(2, 4), packed, accumulate=True)
    with pytest.raises(ValueError, match="out must be a 2-D float32 CPU tensor of contiguous, non-overlapping"):
        kernels.linear(torch.randn(2, 4), packed, out=torch.empty(1, 8).expand(2, 8))  # both rows in one place
    shared = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="out overlaps x"):
        kernels.linear(shared[:, :4], packed, out=shared)
    with pytest.raises(ValueError, match="x must be a 2-D float32 CPU"):
        kernels.linear(torch.randn(2, 4, device="meta"), packed)
    narrow = PackedWeight(torch.zeros(2, 4, kernels.panel_width // 2), None, 8, 4)  # another build's panel width
    with pytest.raises(ValueError, match="packed panels must be a contiguous torch.float32 CPU tensor of shape"):
        kernels.linear(torch.randn(2, 4), narrow)
    int8 = kernels.pack(w, "int8")
    with pytest.raises(ValueError, match="int8 panels need their group scales and minimums"):
        kernels.linear(torch.randn(2, 4), PackedWeight(int8.panels, None, 8, 4))


def test_build_failures_say_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(CpuKernelUnavailable, match="no C\\+\\+ compiler"):
        CpuLinearKernels(tmp_path)


def test_an_int8_build_failure_leaves_float32_working(tmp_path, monkeypatch):
    """The int8 kernels are their own library, built on first int8 use: where it fails to build, float32 still
    runs and int8 says why."""
    broken = tmp_path / "linear_int8.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(linear_cpu, "_INT8_SOURCE", broken)
    kernels = CpuLinearKernels(tmp_path / "build")
    w, x = torch.eye(4), torch.randn(2, 4)
    assert torch.equal(kernels.linear(x, kernels.pack(w, "float32")), x)
    with pytest.raises(CpuKernelUnavailable, match="compiling linear_int8.cpp failed"):
        kernels.pack(w, "int8")


# --- bfloat16 panels (AVX512-BF16 / AMX) ---------------------------------------------------------------------------

BF16_UNIT_ROUNDOFF = 2.0 ** -8  # round to nearest even with 8 significant bits


BF16_BUILDS = {"vdpbf16ps": "1", "fma": "3"}  # the kernels of a CPU without AMX, each forced (OMNI_BF16_KERNEL)


@pytest.fixture(scope="module", params=["native", *BF16_BUILDS])
def bf16_kernels(request, tmp_path_factory):
    """The bfloat16 kernels as the engine builds them (AMX tiles where the CPU has AMX, else the measured choice of
    the two below) and built without AMX with each of an AVX512-BF16 CPU's two kernels forced (vdpbf16ps tiles, and
    float32 tiles over the pairs widened); skipped where the CPU has no AVX512-BF16."""
    if request.param == "native":
        built = CpuLinearKernels(tmp_path_factory.mktemp("linear"))
    else:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(CpuLinearKernels, "FLAGS", CpuLinearKernels.FLAGS + [
                "-mno-amx-tile", f"-DOMNI_BF16_KERNEL={BF16_BUILDS[request.param]}"])
            built = CpuLinearKernels(tmp_path_factory.mktemp(f"linear_{request.param}"))
    if built.bf16_kernel is None:
        pytest.skip("this CPU has no AVX512-BF16")
    built.build = request.param
    return built


def test_bf16_kernel_is_the_cpus(bf16_kernels):
    flags = set(cpu_features().split())
    want = {"vdpbf16ps": {"avx512_bf16"}, "fma": {"avx512_fma"},
            "native": {"amx"} if "amx_bf16" in flags else {"avx512_bf16", "avx512_fma"}}[bf16_kernels.build]
    assert bf16_kernels.bf16_kernel in want


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 12, 13, 16, 17, 31, 32, 33, 64, 65, 100])
@pytest.mark.parametrize("n,k", [(1, 1), (17, 7), (48, 64), (100, 576), (33, 1537)])
def test_bf16_panels_match_float64(bf16_kernels, m, n, k):
    """Against the float64 product of the bf16-rounded operands: within the bound of a float32 sum of K exact
    products in any order (the AMX tile's order is the hardware's; gamma_K holds for every order), plus K flushed
    denormals; against the float32 operands also within the two roundings to bf16 (2 u_bf16 + u_bf16^2 per
    product). A kernel that truncated instead of rounding to nearest even would miss the first bound."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, bias = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = bf16_kernels.pack(w, "bfloat16")
    assert packed.format == "bfloat16" and packed.panels.shape[1] % 16 == 0 and packed.panels.shape[1] * 2 >= k
    x_bf16, w_bf16 = x.bfloat16().float(), w.bfloat16().float()
    assert torch.equal(bf16_kernels.dequantize(packed), w_bf16)
    got = bf16_kernels.linear(x, packed, bias)
    flushed = k * 2.0 ** -126
    want = x_bf16.double() @ w_bf16.double().T + bias.double()
    _assert_within(got, want, _bound(x_bf16, w_bf16, 1) + bias.double().abs() * UNIT_ROUNDOFF + flushed)
    exact = x.double() @ w.double().T + bias.double()
    magnitude = x.double().abs() @ w.double().abs().T
    _assert_within(got, exact, _bound(x_bf16, w_bf16, 1) + bias.double().abs() * UNIT_ROUNDOFF + flushed
                   + (2 * BF16_UNIT_ROUNDOFF + BF16_UNIT_ROUNDOFF ** 2) * magnitude)


def test_bf16_each_row_is_the_same_whatever_the_batch(bf16_kernels):
    """Batch invariance of the bf16 panels: a row's outputs are bit for bit the same alone and at every position of
    batches of 2 to 70 rows (one and two 16-row AMX tiles, several 32-row blocks, every vdpbf16ps or FMA tile)."""
    gen = torch.Generator().manual_seed(12)
    n, k = 5 * bf16_kernels.panel_width + 3, 100
    packed = bf16_kernels.pack(torch.randn(n, k, generator=gen), "bfloat16")
    x = torch.randn(70, k, generator=gen)
    alone = torch.cat([bf16_kernels.linear(x[i : i + 1], packed) for i in range(len(x))])
    for m in range(2, len(x) + 1):
        assert torch.equal(bf16_kernels.linear(x[:m], packed), alone[:m]), f"batch of {m}"


def test_bf16_rows_in_blocks_equal_rows_alone(bf16_kernels):
    _rows_in_blocks_equal_rows_alone(bf16_kernels, "bfloat16")


def test_bf16_empty_k_gives_the_bias(bf16_kernels):
    """K = 0 (no pairs, rows of 0 bytes): every row is the bias, for more rows than one tile (the row-block split
    must not divide by the row size)."""
    bias = torch.randn(7, generator=torch.Generator().manual_seed(6))
    packed = bf16_kernels.pack(torch.empty(7, 0), "bfloat16")
    assert torch.equal(bf16_kernels.linear(torch.empty(40, 0), packed, bias), bias.expand(40, 7))


def test_the_fma_and_vdpbf16ps_kernels_agree_bit_for_bit(bf16_kernels, tmp_path_factory):
    """The FMAs on widened pairs sum the same exact products in vdpbf16ps's order (pair by pair into one float32
    accumulator), so on normal-range inputs both kernels give the same bits (the file comment's promise)."""
    if bf16_kernels.build != "fma":
        pytest.skip("compared once, from the forced FMA build")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CpuLinearKernels, "FLAGS", CpuLinearKernels.FLAGS + ["-mno-amx-tile", "-DOMNI_BF16_KERNEL=1"])
        vdp = CpuLinearKernels(tmp_path_factory.mktemp("linear_vdpbf16ps_cmp"))
    gen = torch.Generator().manual_seed(13)
    for m, n, k in [(1, 64, 64), (5, 100, 577), (33, 70, 1537)]:
        w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
        assert torch.equal(bf16_kernels.linear(x, bf16_kernels.pack(w, "bfloat16")), vdp.linear(x, vdp.pack(w, "bfloat16")))


def test_bf16_bias_accumulate_and_strided_rows(bf16_kernels):
    gen = torch.Generator().manual_seed(4)
    m, n, k = 37, 35, 40
    x = torch.randn(m, k + 8, generator=gen)[:, 4 : 4 + k]  # rows of stride k + 8
    w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = bf16_kernels.pack(w, "bfloat16")
    out_wide = torch.randn(m, n + 3, generator=gen)
    out = out_wide[:, :n]
    before, beyond = out.clone(), out_wide[:, n:].clone()
    bf16_kernels.linear(x, packed, bias, out=out, accumulate=True)
    want = bf16_kernels.linear(x.contiguous(), packed, bias) + before  # (x @ W + bias) + y, the kernel's order
    assert torch.equal(out, want)
    assert torch.equal(out_wide[:, n:], beyond), "columns beyond N untouched"


def test_bf16_refused_where_the_cpu_lacks_it(kernels):
    if kernels.bf16_kernel is not None:
        pytest.skip("this build has bfloat16 panels")
    with pytest.raises(CpuKernelUnavailable, match="bfloat16 panels need AVX512-BF16"):
        kernels.pack(torch.randn(4, 4), "bfloat16")
