"""The machine-limit loops the CPU-step benchmark measures against (kernels/machine_limits.py): each peak is there
exactly where the CPU has the instruction, and within what a core can physically do (a loop the compiler folded
away would report an absurd rate; one that spilled to memory a tiny one)."""

import os
import shutil

import pytest
import torch

from kernels.cpu_library import cpu_features
from kernels.machine_limits import MachineLimits

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")

GHZ_MAX = 6.5  # no x86 core clocks higher


@pytest.fixture(scope="module")
def limits(tmp_path_factory):
    torch.set_num_threads(1)
    return MachineLimits(tmp_path_factory.mktemp("limits"))


def test_peaks_exist_where_the_cpu_has_the_instruction_and_are_physical(limits):
    flags = set(cpu_features().split())
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    fma = limits.peak_flops("fma_f32", seconds=0.05)
    # at most 2 FMA units x lanes x 2 FLOP per cycle; at least a tenth of one unit at 1 GHz (a shared machine)
    assert 0.1 * lanes * 2 * 1e9 < fma < 2 * lanes * 2 * GHZ_MAX * 1e9
    dot = limits.peak_flops("dot_bf16", seconds=0.05)
    assert (dot > 0) == ("avx512_bf16" in flags)
    assert dot < 2 * 16 * 4 * GHZ_MAX * 1e9  # two ports x 16 lanes x 2 multiply-adds
    int8 = limits.peak_flops("dot_int8", seconds=0.05)
    vnni = {"avx512_vnni", "avx512bw"} <= flags or "avx_vnni" in flags and "avx512f" not in flags
    assert (int8 > 0) == vnni
    assert int8 < 2 * lanes * 4 * 2 * GHZ_MAX * 1e9  # two ports x lanes x 4 multiply-adds
    amx = limits.peak_flops("amx_bf16", seconds=0.05)
    assert (amx > 0) == ("amx_bf16" in flags)
    assert amx < 1024 * 2 * GHZ_MAX * 1e9  # one TMUL: 1,024 bf16 multiply-adds per cycle (Intel's AMX figure)


def test_bandwidths_are_those_of_memory(limits):
    read, triad = limits.read_bytes_per_s(mib=64, repeats=2), limits.triad_bytes_per_s(mib=64, repeats=2)
    for rate in (read, triad):
        assert 1e9 < rate < 1e12  # DRAM on one core: GB/s, never below 1 nor TB/s
