"""omni_backend.ops.torch_flavor: the torch build chosen from the driver, its pip lines, the installed-environment
check (facts injected), and the command line scripts/setup.sh runs before torch is installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from omni_backend import paths
from omni_backend.ops.fake_nvml import FakeGpu, FakeNvml
from omni_backend.ops import torch_flavor
from omni_backend.ops.torch_flavor import FLAVORS, Driver, InstalledTorch

# Requires-Dist of PyPI's torch 2.13.0 Linux x86_64 wheel (its PEP 658 metadata), the lines that name triton/CUDA
CU130_REQUIRES = [
    "filelock",
    'cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3; '
    'platform_system == "Linux"',
    'triton==3.7.1; platform_system == "Linux" and python_version < "3.15"',
    'optree>=0.13.0; extra == "optree"',
]
CPU_REQUIRES = ["filelock", "typing-extensions>=4.10.0", 'pyyaml; extra == "pyyaml"']


def gpu_driver(major: int, minor: int) -> Driver:
    return Driver(gpus=1, cuda=(major, minor))


@pytest.mark.parametrize("driver_cuda, flavor", [
    ((13, 4), "cu130"), ((13, 0), "cu130"), ((12, 9), "cu129"), ((12, 8), "cu126"), ((12, 6), "cu126"),
])
def test_the_newest_flavour_the_driver_supports_is_chosen(driver_cuda, flavor):
    assert torch_flavor.select_flavor(None, gpu_driver(*driver_cuda)).name == flavor


def test_cpu_without_nvml_or_without_a_gpu():
    assert torch_flavor.select_flavor(None, None).name == "cpu"
    assert torch_flavor.select_flavor("", Driver(gpus=0, cuda=(13, 0))).name == "cpu"


@pytest.mark.parametrize("driver_cuda", [(12, 4), (11, 8)])
def test_a_driver_older_than_every_flavour_stops_setup_naming_both_versions(driver_cuda):
    with pytest.raises(ValueError) as error:
        torch_flavor.select_flavor(None, gpu_driver(*driver_cuda))
    message = str(error.value)
    assert f"supports CUDA {driver_cuda[0]}.{driver_cuda[1]}" in message and "needs CUDA 12.6" in message
    assert "OMNI_TORCH_CUDA=cpu" in message


def test_override_wins_over_the_driver_and_bad_values_list_the_valid_ones():
    assert torch_flavor.select_flavor("cu126", gpu_driver(13, 0)).name == "cu126"
    assert torch_flavor.select_flavor("cpu", gpu_driver(13, 0)).name == "cpu"
    for bad in ("cu128", "cuda", "CU130", "13.0"):
        with pytest.raises(ValueError, match=r"valid: cpu, cu126, cu129, cu130"):
            torch_flavor.select_flavor(bad, None)


def test_driver_read_through_nvml():
    assert torch_flavor.nvidia_driver(FakeNvml(cuda_driver_version=12080)) == Driver(gpus=1, cuda=(12, 8))
    assert torch_flavor.nvidia_driver(FakeNvml([FakeGpu(), FakeGpu(uuid="GPU-1")], cuda_driver_version=13020)) == \
        Driver(gpus=2, cuda=(13, 2))
    assert torch_flavor.nvidia_driver(FakeNvml(gpus=[])) == Driver(gpus=0, cuda=(13, 0))
    assert torch_flavor.nvidia_driver(FakeNvml(missing=True)) is None
    fake = FakeNvml()
    torch_flavor.nvidia_driver(fake)
    assert not fake.initialized  # shut down after reading


def test_requirement_lines():
    assert FLAVORS["cu130"].requirements == ("torch==2.13.0",)
    assert FLAVORS["cpu"].requirements == ("torch==2.13.0", "triton==3.7.1")
    assert FLAVORS["cu126"].requirements == ("--extra-index-url https://download.pytorch.org/whl/cu126",
                                             "torch==2.13.0+cu126")
    assert FLAVORS["cu129"].requirements == ("--extra-index-url https://download.pytorch.org/whl/cu129",
                                             "torch==2.13.0+cu129")
    assert [f.triton_pin for f in FLAVORS.values()] == ["3.7.1", "", "", ""]


def test_triton_declared_by_torch_from_its_metadata():
    assert torch_flavor.triton_declared_by_torch(CU130_REQUIRES) == "3.7.1"
    assert torch_flavor.triton_declared_by_torch(CPU_REQUIRES) == ""
    # a marker that does not hold here (Python 3.15+) declares nothing for this environment
    assert torch_flavor.triton_declared_by_torch(['triton==3.7.1; python_version >= "3.15"']) == ""


def facts(version="2.13.0", cuda=(13, 0), declared="3.7.1", installed="3.7.1") -> InstalledTorch:
    return InstalledTorch(version=version, cuda=cuda, triton_declared=declared, triton_installed=installed)


def test_a_fitting_environment_has_no_problems():
    assert torch_flavor.environment_problems(FLAVORS["cu130"], facts(), gpu_driver(13, 4)) == []
    assert torch_flavor.environment_problems(FLAVORS["cu126"], facts("2.13.0+cu126", (12, 6)), gpu_driver(12, 8)) == []
    cpu_wheel = facts("2.13.0+cpu", None, declared="")
    assert torch_flavor.environment_problems(FLAVORS["cpu"], cpu_wheel, None) == []
    # the cpu flavour on a machine without the local CPU wheel gets PyPI's CUDA build: fine without a GPU
    assert torch_flavor.environment_problems(FLAVORS["cpu"], facts(), None) == []


def test_triton_other_than_the_one_torch_declares_is_named_with_both_versions():
    assert torch_flavor.environment_problems(FLAVORS["cu130"], facts(installed="3.9.0"), None) == [
        "triton 3.9.0 is installed, torch 2.13.0 declares triton==3.7.1"]
    assert torch_flavor.environment_problems(FLAVORS["cpu"], facts("2.13.0+cpu", None, "", "3.9.0"), None) == [
        "triton 3.9.0 is installed, flavour cpu pins triton==3.7.1"]


def test_torch_newer_than_the_driver_is_named_with_both_versions_and_the_fix():
    problems = torch_flavor.environment_problems(FLAVORS["cu130"], facts(), gpu_driver(12, 8))
    assert problems == ["torch 2.13.0 is built for CUDA 13.0, newer than the CUDA 12.8 the NVIDIA driver supports: "
                        "set OMNI_TORCH_CUDA=cu126 and rerun scripts/setup.sh (or upgrade the driver)"]
    # without a GPU, the driver's CUDA does not matter
    assert torch_flavor.environment_problems(FLAVORS["cu130"], facts(), Driver(gpus=0, cuda=(12, 8))) == []


def test_a_cuda_flavour_with_another_build_installed_is_named():
    assert torch_flavor.environment_problems(FLAVORS["cu130"], facts("2.13.0+cpu", None, "", "3.7.1"), None) == [
        "torch 2.13.0+cpu is built for CUDA none, flavour cu130 is CUDA 13.0"]
    assert torch_flavor.environment_problems(FLAVORS["cu130"], facts("2.12.0", (13, 0)), None) == [
        "torch 2.12.0 is installed, setup installs torch 2.13.0"]


def run_cli(*args: str, input: str | None = None, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "OMNI_TORCH_CUDA"}
    return subprocess.run([sys.executable, "-m", "omni_backend.ops.torch_flavor", *args], cwd=paths.PROJECT_ROOT,
                          env={**environment, "PYTHONPATH": str(paths.PROJECT_ROOT), **env}, capture_output=True,
                          text=True, timeout=60, input=input)


def test_command_line_prints_the_lines_and_refuses_unknown_flavours():
    run = run_cli("requirements", "cu126")
    assert (run.returncode, run.stdout) == (0, "--extra-index-url https://download.pytorch.org/whl/cu126\n"
                                               "torch==2.13.0+cu126\n")
    run = run_cli("choose", OMNI_TORCH_CUDA="cu129")
    assert (run.returncode, run.stdout) == (0, "cu129\n")
    run = run_cli("requirements", OMNI_TORCH_CUDA="cu12")
    assert run.returncode == 1 and run.stdout == ""
    assert "OMNI_TORCH_CUDA='cu12' is not a torch flavour; valid: cpu, cu126, cu129, cu130" in run.stderr


def test_the_module_imports_nothing_outside_the_standard_library():
    """setup.sh runs it before torch (and anything else) is installed."""
    code = ("import sys; before = set(sys.modules); import omni_backend.ops.torch_flavor; "
            "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)))")
    run = subprocess.run([sys.executable, "-c", code], cwd=paths.PROJECT_ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(paths.PROJECT_ROOT)}, timeout=60)
    assert (run.returncode, run.stdout.strip()) == (0, "['omni_backend']"), run.stderr


def test_this_machines_environment_passes_the_check():
    """scripts/setup.sh installed the flavour it chose; the check it ran then must still hold."""
    run = run_cli("check")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("[torch_flavor] torch 2.13.0") and run.stdout.rstrip().endswith(": ok")


def _pip_without_the_wheel(tmp_path, *extra: str) -> str:
    """What pip prints for the cu126 torch against an index that has no such wheel (an empty folder; the machine's
    pip configuration ignored, so no other index or constraint comes in)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links",
                          str(tmp_path), *extra, "torch==2.13.0+cu126"], capture_output=True, text=True,
                         env={**environment, "PIP_CONFIG_FILE": os.devnull}, timeout=120)
    assert run.returncode == 1
    return run.stdout + run.stderr


@pytest.mark.parametrize("constrained", [False, True], ids=["plain", "with a constraint file"])
def test_setup_explains_a_flavour_whose_wheel_the_registry_does_not_have(tmp_path, constrained):
    """pip's real output (its plain "No matching distribution" and, when a constraint file is configured, its
    ResolutionImpossible report) becomes the message setup stops with: the wheel, the index, the alternatives."""
    extra = ()
    if constrained:
        (tmp_path / "constraints.txt").write_text("torch<=2.14.1\n")
        extra = ("-c", str(tmp_path / "constraints.txt"))
    run = run_cli("install-failure", "cu126", input=_pip_without_the_wheel(tmp_path, *extra))
    assert run.returncode == 1
    assert ("pip found no wheel for torch==2.13.0+cu126 (cu126 flavour) for CPython "
            f"{sys.version_info.major}.{sys.version_info.minor}") in run.stderr
    assert "at https://download.pytorch.org/whl/cu126" in run.stderr
    assert "no wheel of this flavour has been resolved from the project's workplace" in run.stderr
    assert "OMNI_TORCH_CUDA=cu130" in run.stderr and "rerun scripts/setup.sh" in run.stderr


def test_other_install_failures_are_left_to_pips_own_message():
    run = run_cli("install-failure", "cu130", input="ERROR: No matching distribution found for numpy==0.0.1\n")
    assert (run.returncode, run.stderr) == (0, "")
    message = torch_flavor.install_failure_message(
        FLAVORS["cu130"], "ERROR: No matching distribution found for torch==2.13.0\n")
    assert message.startswith("pip found no wheel for torch==2.13.0 (cu130 flavour)") and "at PyPI:" in message
    assert "resolved from the project's workplace" not in message
