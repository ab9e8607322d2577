"""GPU inventory and readings through NVML (fake source here), and dtype/kernel rules by compute capability."""

from __future__ import annotations

import json

import pytest
import torch

from omni_backend.ops import hardware
from omni_backend.ops.fake_nvml import FakeGpu, FakeNvml


def test_inventory_and_readings_in_si_units():
    fake = FakeNvml([FakeGpu(name="A", compute_capability=(8, 0), memory_bytes=40 << 30, power_limit_w=400,
                             slowdown_temp_c=None),
                     FakeGpu(name="B", uuid="GPU-b", compute_capability=(7, 5), power_limit_w=70,
                             power_w=31.5, temperature_c=61, sm_clock_mhz=1590)])
    nvml = hardware.Nvml(fake)
    a, b = nvml.inventory()
    assert (a.index, a.name, a.compute_capability, a.memory_bytes, a.power_limit_w, a.slowdown_temp_c) == (
        0, "A", (8, 0), 40 << 30, 400.0, None)
    assert (b.name, b.compute_capability, b.power_limit_w, b.slowdown_temp_c) == ("B", (7, 5), 70.0, 90.0)
    assert nvml.read(1) == hardware.GpuReading(power_w=31.5, temperature_c=61.0, sm_clock_mhz=1590.0)
    assert nvml.index_of_uuid("GPU-b") == 1


def test_fake_from_file_is_reread_at_every_reading(tmp_path, monkeypatch):
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps({"power_w": 120, "temperature_c": 50, "power_limit_w": 300}))
    monkeypatch.setenv("OMNI_NVML_FAKE", str(path))
    nvml = hardware.open_nvml()
    assert nvml.info(0).power_limit_w == 300.0
    assert nvml.read(0).power_w == 120.0
    path.write_text(json.dumps({"power_w": 290, "temperature_c": 93}))
    assert (nvml.read(0).power_w, nvml.read(0).temperature_c) == (290.0, 93.0)


def test_no_nvml_library_raises_unavailable():
    with pytest.raises(hardware.NvmlUnavailable, match="NVML Shared Library Not Found"):
        hardware.Nvml(FakeNvml(missing=True))


def test_real_pynvml_on_a_machine_without_a_driver_raises_unavailable():
    try:
        hardware.Nvml().close()
    except hardware.NvmlUnavailable as exc:
        assert "NVML unavailable" in str(exc)
    else:
        pytest.skip("this machine has an NVIDIA driver")


@pytest.mark.parametrize("capability, dtype, backend", [
    ((9, 0), torch.bfloat16, "triton"), ((8, 0), torch.bfloat16, "triton"), ((7, 5), torch.float16, "triton"),
    ((6, 1), torch.float16, "torch"),
])
def test_dtype_and_kernels_follow_compute_capability(capability, dtype, backend):
    gpu = hardware.Nvml(FakeNvml([FakeGpu(name="any name", compute_capability=capability)])).info(0)
    cuda = torch.device("cuda", 0)
    assert hardware.select_dtype("auto", cuda, gpu.compute_capability) == dtype
    assert hardware.select_attention_backend("auto", cuda, gpu.compute_capability)[0] == backend
    if capability < (8, 0):
        with pytest.raises(ValueError, match="bfloat16 needs compute capability"):
            hardware.select_dtype("bfloat16", cuda, capability)
    if backend == "torch":
        with pytest.raises(ValueError, match="attention_backend=triton"):
            hardware.select_attention_backend("triton", cuda, capability)


def test_cpu_device_picks_the_cpu_kernel_and_cpu_is_refused_for_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert hardware.select_attention_backend("auto", cpu, None)[0] == "cpu"
    assert hardware.select_attention_backend("torch", cpu, None) == ("torch", "requested")
    with pytest.raises(ValueError, match="attention_backend=triton"):
        hardware.select_attention_backend("triton", cpu, None)
    with pytest.raises(ValueError, match="attention_backend=cpu runs on CPU tensors"):
        hardware.select_attention_backend("cpu", torch.device("cuda", 0), (9, 0))


def test_gpu_memory_budget_is_checked_and_does_nothing_on_cpu():
    from omni_backend.ops.gpu_budget import apply_gpu_memory_budget

    apply_gpu_memory_budget("cpu", 0.5, "llm")  # a CPU stage has no device budget
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="llm: the GPU memory fraction must be in"):
            apply_gpu_memory_budget("cpu", bad, "llm")
