"""GPU inventory and readings through NVML (fake source here), dtype/kernel rules by compute capability (the
attention backend's first choice: engine/attention/selector.py), and device resolution with the versions that
explain it."""

from __future__ import annotations

import importlib.metadata
import json
import logging

import pytest
import torch

from omni_backend.engine.attention.selector import first_choice
from omni_backend.ops import hardware
from omni_backend.ops.fake_nvml import FakeGpu, FakeNvml
from omni_backend.ops import torch_flavor


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
    assert first_choice("auto", cuda, gpu.compute_capability)[0] == backend
    if capability < (8, 0):
        with pytest.raises(ValueError, match="bfloat16 needs compute capability"):
            hardware.select_dtype("bfloat16", cuda, capability)
    if backend == "torch":
        with pytest.raises(ValueError, match="attention_backend=triton"):
            first_choice("triton", cuda, capability)


def test_cpu_device_picks_the_cpu_kernel_and_cpu_is_refused_for_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert first_choice("auto", cpu, None)[0] == "cpu"
    assert first_choice("torch", cpu, None) == ("torch", "requested")
    with pytest.raises(ValueError, match="attention_backend=triton"):
        first_choice("triton", cpu, None)
    with pytest.raises(ValueError, match="attention_backend=cpu runs on CPU tensors"):
        first_choice("cpu", torch.device("cuda", 0), (9, 0))


# --- device resolution and runtime versions (torch and NVML facts injected) -----------------------------------


def facts(torch_version="2.13.0", torch_cuda="13.0", usable=True, devices=1, driver=(13, 0), gpus=1):
    return hardware.CudaFacts(torch_version=torch_version, torch_cuda=torch_cuda, cuda_usable=usable,
                              device_count=devices if usable else 0,
                              driver=None if driver is None else torch_flavor.Driver(gpus=gpus, cuda=driver))


CPU_WHEEL_ON_A_GPU_MACHINE = facts("2.13.0+cpu", "", usable=False, driver=(12, 8))
CUDA13_TORCH_ON_A_CUDA12_DRIVER = facts("2.13.0", "13.0", usable=False, driver=(12, 8))


def test_auto_picks_cuda_when_torch_can_use_it_and_cpu_without_a_gpu(caplog):
    assert hardware.resolve_device("auto", facts()) == "cuda"
    assert hardware.resolve_device("auto", facts("2.13.0+cpu", "", usable=False, driver=None)) == "cpu"
    assert hardware.resolve_device("auto", facts(usable=False, gpus=0)) == "cpu"
    assert hardware.resolve_device("cpu", CPU_WHEEL_ON_A_GPU_MACHINE) == "cpu"
    assert caplog.records == []


def test_auto_on_a_gpu_torch_cannot_use_warns_with_both_cuda_versions_and_the_fix(caplog):
    with caplog.at_level(logging.WARNING, logger="omni_backend.ops.hardware"):
        assert hardware.resolve_device("auto", CPU_WHEEL_ON_A_GPU_MACHINE) == "cpu"
        assert hardware.resolve_device("auto", CUDA13_TORCH_ON_A_CUDA12_DRIVER) == "cpu"
    cpu_wheel, cuda13 = (record.getMessage() for record in caplog.records)
    assert [record.levelname for record in caplog.records] == ["WARNING", "WARNING"]
    assert cpu_wheel == (
        "device auto runs on CPU: torch 2.13.0+cpu cannot use CUDA (torch's CUDA: none (a CPU build); NVML sees 1 "
        "GPU(s), the NVIDIA driver supports CUDA 12.8): set OMNI_TORCH_CUDA=cu126 and rerun scripts/setup.sh (or "
        "upgrade the driver)")
    assert "torch 2.13.0 cannot use CUDA (torch's CUDA: 13.0;" in cuda13 and "supports CUDA 12.8" in cuda13
    assert "OMNI_TORCH_CUDA=cu126" in cuda13


def test_auto_warning_when_torch_fits_the_driver_points_at_device_access(caplog):
    with caplog.at_level(logging.WARNING, logger="omni_backend.ops.hardware"):
        assert hardware.resolve_device("auto", facts(usable=False, driver=(13, 2))) == "cpu"
    assert "torch's CUDA: 13.0;" in caplog.text and "supports CUDA 13.2" in caplog.text
    assert "CUDA_VISIBLE_DEVICES" in caplog.text and "OMNI_TORCH_CUDA" not in caplog.text


@pytest.mark.parametrize("requested", ["cuda", "cuda:0"])
def test_explicit_cuda_that_torch_cannot_use_raises_with_the_same_facts(requested):
    with pytest.raises(RuntimeError) as error:
        hardware.resolve_device(requested, CUDA13_TORCH_ON_A_CUDA12_DRIVER)
    message = str(error.value)
    assert message.startswith(f"device {requested} requested, but torch 2.13.0 cannot use CUDA")
    assert "torch's CUDA: 13.0" in message and "supports CUDA 12.8" in message and "OMNI_TORCH_CUDA=cu126" in message
    with pytest.raises(RuntimeError, match="NVML sees 0 GPU"):
        hardware.resolve_device(requested, facts("2.13.0+cpu", "", usable=False, driver=None))


def test_cuda_index_must_exist_and_bad_strings_are_refused():
    two = facts(devices=2)
    assert [hardware.resolve_device(d, two) for d in ("cuda", "cuda:0", "cuda:1")] == ["cuda", "cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match="device cuda:2: torch sees 2 CUDA device"):
        hardware.resolve_device("cuda:2", two)
    for bad in ("gpu", "CUDA", "cuda:", "cuda:-1", "cuda:x", "cuda0", " cpu", "", None):
        with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
            hardware.resolve_device(bad, two)


def test_runtime_versions_name_torch_cuda_driver_and_triton():
    versions = hardware.runtime_versions(CUDA13_TORCH_ON_A_CUDA12_DRIVER)
    assert {k: versions[k] for k in ("torch", "cuda_runtime", "cuda_driver")} == {
        "torch": "2.13.0", "cuda_runtime": "13.0", "cuda_driver": "12.8"}
    assert set(versions) == {"torch", "cuda_runtime", "cuda_driver", "triton", "triton_declared_by_torch"}
    assert versions["triton"] == importlib.metadata.version("triton")
    assert hardware.runtime_versions(facts(driver=None))["cuda_driver"] == ""


def test_this_machines_facts():
    """Probed for real: a CPU machine here (NVML finds no driver), a CUDA build on a GPU machine."""
    probed = hardware.cuda_facts()
    assert probed.torch_version == torch.__version__ and probed.cuda_usable == torch.cuda.is_available()
    assert probed.torch_cuda == (torch.version.cuda or "")
    versions = hardware.runtime_versions(probed)
    # the CPU wheel declares no triton; a CUDA build declares the one installed (torch_flavor's check)
    assert versions["triton_declared_by_torch"] == ("" if torch.version.cuda is None else versions["triton"])
    if not probed.cuda_usable and probed.nvml_gpus == 0:
        assert hardware.resolve_device("auto", probed) == "cpu"


def test_gpu_memory_budget_is_checked_and_does_nothing_on_cpu():
    from omni_backend.ops.gpu_budget import apply_gpu_memory_budget

    apply_gpu_memory_budget("cpu", 0.5, "llm")  # a CPU stage has no device budget
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="llm: the GPU memory fraction must be in"):
            apply_gpu_memory_budget("cpu", bad, "llm")


@pytest.mark.parametrize("requested,cores,threads", [(0, 2, 1), (0, 1, 1), (0, 16, 15), (3, 2, 3), (1, 16, 1)])
def test_cpu_engine_threads_leave_one_core_for_the_server(requested, cores, threads):
    assert hardware.cpu_engine_threads(requested, cores) == threads


def test_cpu_engine_threads_refuse_a_negative_count():
    with pytest.raises(ValueError, match="cpu_threads"):
        hardware.cpu_engine_threads(-1, 4)
