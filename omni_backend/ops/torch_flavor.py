"""Which torch build ("flavour") a machine installs, the pip lines for it, and a check of the installed result.

The one place that says which torch and which CUDA: scripts/setup.sh and docker/Dockerfile run this module
before torch is installed (stdlib only at import; pynvml and packaging are imported where they are used):

    python -m omni_backend.ops.torch_flavor choose               # the flavour name for this machine
    python -m omni_backend.ops.torch_flavor requirements [NAME]  # its pip requirement lines
    python -m omni_backend.ops.torch_flavor check [NAME]         # installed torch/triton fit it and the driver
    python -m omni_backend.ops.torch_flavor install-failure NAME < pip-output   # why pip found no such torch

Flavours of torch 2.13.0 (`FLAVORS`):
    cpu    torch==2.13.0 and triton==3.7.1. Here pip's find-links holds a CPU wheel (2.13.0+cpu), which declares no
           triton; 3.7.1 is the triton the CUDA build declares, so interpreter tests run the Triton a GPU runs.
           Without such a wheel pip takes PyPI's 2.13.0, the CUDA 13.0 build, which also runs on CPU.
    cu126  torch==2.13.0+cu126 from https://download.pytorch.org/whl/cu126 (CUDA 12.6)
    cu129  torch==2.13.0+cu129 from https://download.pytorch.org/whl/cu129 (CUDA 12.9)
    cu130  torch==2.13.0 from PyPI: its Linux x86_64 wheel is the CUDA 13.0 build (its PEP 658 metadata lists
           cuda-toolkit[...]==13.0.3, nvidia-cudnn-cu13==9.20.0.48 and triton==3.7.1)
Only cpu and cu130 are verified from our workplace, which reaches PyPI but not download.pytorch.org: no cu12x wheel
has been resolved from here. When pip finds no torch wheel for the flavour (not published for this Python and
platform, or the index unreachable), setup stops with `install_failure_message`'s explanation. The cu12x
flavours follow PyTorch's release matrix for 2.13 (pytorch/pytorch RELEASE.md, "Release Compatibility Matrix":
stable CUDA 12.6 and 13.0, experimental 13.2; no 12.8 build since 2.12) and the 2.13.0 wheel build matrix
(.github/scripts/generate_binary_build_matrix.py: CUDA_ARCHES 12.6, 12.9, 13.0, 13.2), read from copies, not from
the index itself. 13.2 is left out: it is experimental, and a CUDA 13.x driver runs cu130. CUDA flavours pin no
triton: pip installs exactly the one torch declares.

Choice (`select_flavor`): `OMNI_TORCH_CUDA` when set (a flavour name; anything else is an error listing them),
else the newest CUDA flavour whose CUDA is not newer than the one the NVIDIA driver supports (NVML), else `cpu`
when NVML is unavailable or sees no GPU. A driver older than every CUDA flavour (below 12.6) is an error naming
both versions: setup stops rather than install a torch built for a newer CUDA than the driver's (OMNI_TORCH_CUDA=cpu
runs on CPU).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import re
import sys
from dataclasses import dataclass

TORCH_VERSION = "2.13.0"
ENV_VAR = "OMNI_TORCH_CUDA"


@dataclass(frozen=True)
class Flavor:
    """One torch build.

    Attributes:
        name: the `OMNI_TORCH_CUDA` value ("cpu", "cu130", ...).
        cuda: (major, minor) of the CUDA it is built for, None for the CPU flavour.
        requirements: pip requirement-file lines that install it.
    """

    name: str
    cuda: tuple[int, int] | None
    requirements: tuple[str, ...]

    @property
    def triton_pin(self) -> str:
        """The triton version the lines pin ("" when pip takes the one torch declares)."""
        for line in self.requirements:
            if line.startswith("triton=="):
                return line.removeprefix("triton==")
        return ""


def _download_pytorch_org(name: str, cuda: tuple[int, int]) -> Flavor:
    return Flavor(name, cuda, (f"--extra-index-url https://download.pytorch.org/whl/{name}",
                               f"torch=={TORCH_VERSION}+{name}"))


FLAVORS: dict[str, Flavor] = {
    "cpu": Flavor("cpu", None, (f"torch=={TORCH_VERSION}", "triton==3.7.1")),
    "cu126": _download_pytorch_org("cu126", (12, 6)),
    "cu129": _download_pytorch_org("cu129", (12, 9)),
    "cu130": Flavor("cu130", (13, 0), (f"torch=={TORCH_VERSION}",)),
}


def version_text(version: tuple[int, int] | None) -> str:
    """(12, 8) -> "12.8"; None -> "none"."""
    return "none" if version is None else f"{version[0]}.{version[1]}"


@dataclass(frozen=True)
class Driver:
    """What NVML reports: the number of GPUs and the newest CUDA (major, minor) the driver supports."""

    gpus: int
    cuda: tuple[int, int]


def nvidia_driver(nvml=None) -> Driver | None:
    """Read the NVIDIA driver through NVML; None when NVML cannot be used (no library, no driver).

    Args:
        nvml: a pynvml-compatible module (default: pynvml from nvidia-ml-py; `fake_nvml.FakeNvml` in tests).

    The CUDA version comes from nvmlSystemGetCudaDriverVersion_v2, encoded as 1000 * major + 10 * minor
    (nvml.h: NVML_CUDA_DRIVER_VERSION_MAJOR(v) = v / 1000, NVML_CUDA_DRIVER_VERSION_MINOR(v) = (v % 1000) / 10;
    12080 is CUDA 12.8).
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:  # nvidia-ml-py not installed yet (setup.sh installs it first)
            return None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return None
    try:
        gpus = nvml.nvmlDeviceGetCount()
        encoded = nvml.nvmlSystemGetCudaDriverVersion_v2()
    except nvml.NVMLError:
        return None
    finally:
        nvml.nvmlShutdown()
    return Driver(gpus=gpus, cuda=(encoded // 1000, encoded % 1000 // 10))


def select_flavor(requested: str | None, driver: Driver | None) -> Flavor:
    """The flavour to install.

    Args:
        requested: `OMNI_TORCH_CUDA` ("" or None: choose from the driver).
        driver: what NVML reports (`nvidia_driver()`), None when NVML is unavailable.

    Raises:
        ValueError: `requested` is not a flavour name (the message lists them), or the driver supports only a CUDA
            older than every CUDA flavour (the message names both versions).
    """
    if requested:
        if requested not in FLAVORS:
            raise ValueError(f"{ENV_VAR}={requested!r} is not a torch flavour; valid: {', '.join(FLAVORS)}")
        return FLAVORS[requested]
    if driver is None or driver.gpus == 0:
        return FLAVORS["cpu"]
    fitting = [f for f in FLAVORS.values() if f.cuda is not None and f.cuda <= driver.cuda]
    if not fitting:
        oldest = min(f.cuda for f in FLAVORS.values() if f.cuda is not None)
        raise ValueError(
            f"the NVIDIA driver supports CUDA {version_text(driver.cuda)}, and the oldest CUDA build of torch "
            f"{TORCH_VERSION} needs CUDA {version_text(oldest)}: upgrade the driver, or set {ENV_VAR}=cpu to run on CPU")
    return max(fitting, key=lambda f: f.cuda)


# --- the installed environment ------------------------------------------------------------------------------


def triton_declared_by_torch(requires: list[str] | None = None) -> str:
    """The triton version torch's metadata pins for this environment ("" when it declares none: the CPU wheel).

    Args:
        requires: torch's Requires-Dist lines (default: the installed torch's, importlib.metadata.requires).

    Raises:
        importlib.metadata.PackageNotFoundError: torch is not installed (and `requires` is None).
    """
    from packaging.requirements import Requirement

    if requires is None:
        requires = importlib.metadata.requires("torch") or []
    for line in requires:
        requirement = Requirement(line)
        if requirement.name == "triton" and (requirement.marker is None or requirement.marker.evaluate()):
            pins = [s.version for s in requirement.specifier if s.operator == "=="]
            return pins[0] if pins else ""
    return ""


def installed_version(distribution: str) -> str:
    """The installed version of `distribution`, "" when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


@dataclass(frozen=True)
class InstalledTorch:
    """Facts about the installed torch and triton.

    Attributes:
        version: torch.__version__ ("2.13.0+cpu").
        cuda: torch.version.cuda as (major, minor), None for a CPU build.
        triton_declared: triton version torch's metadata pins ("" for none).
        triton_installed: installed triton version ("" when not installed).
    """

    version: str
    cuda: tuple[int, int] | None
    triton_declared: str
    triton_installed: str


def installed_torch() -> InstalledTorch:
    """Read the installed torch (imports it) and triton.

    Raises:
        ImportError: torch is not installed.
    """
    import torch

    cuda = tuple(int(part) for part in torch.version.cuda.split(".")[:2]) if torch.version.cuda else None
    return InstalledTorch(version=torch.__version__, cuda=cuda, triton_declared=triton_declared_by_torch(),
                          triton_installed=installed_version("triton"))


def environment_problems(flavor: Flavor, torch_facts: InstalledTorch, driver: Driver | None) -> list[str]:
    """What is wrong with the installed torch/triton for `flavor` on this driver (empty when nothing is).

    Checked: torch is TORCH_VERSION; the installed triton is the one torch declares (else the flavour's pin); a CUDA
    flavour's torch is built for that CUDA; torch's CUDA is not newer than the driver's when NVML sees a GPU. Across
    major versions (a CUDA 13 torch on a CUDA 12 driver) torch.cuda.is_available() is False; within one major
    version NVIDIA's minor version compatibility runs it with a limited feature set (no JIT of newer PTX; NVIDIA
    "CUDA Compatibility"), which setup does not rely on.
    """
    problems = []
    base = torch_facts.version.split("+")[0]
    if base != TORCH_VERSION:
        problems.append(f"torch {torch_facts.version} is installed, setup installs torch {TORCH_VERSION}")
    expected_triton = torch_facts.triton_declared or flavor.triton_pin
    if expected_triton and torch_facts.triton_installed != expected_triton:
        source = f"torch {torch_facts.version} declares" if torch_facts.triton_declared else f"flavour {flavor.name} pins"
        problems.append(f"triton {torch_facts.triton_installed or '(not installed)'} is installed, {source} "
                        f"triton=={expected_triton}")
    if flavor.cuda is not None and torch_facts.cuda != flavor.cuda:
        problems.append(f"torch {torch_facts.version} is built for CUDA {version_text(torch_facts.cuda)}, flavour "
                        f"{flavor.name} is CUDA {version_text(flavor.cuda)}")
    if driver is not None and driver.gpus > 0 and torch_facts.cuda is not None and torch_facts.cuda > driver.cuda:
        problems.append(f"torch {torch_facts.version} is built for CUDA {version_text(torch_facts.cuda)}, newer than "
                        f"the CUDA {version_text(driver.cuda)} the NVIDIA driver supports: {advice(driver)}")
    return problems


def advice(driver: Driver) -> str:
    """How to get a torch this driver can run: the flavour to set and rerun setup with, or a driver upgrade."""
    try:
        fitting = select_flavor(None, driver)
    except ValueError as exc:
        return str(exc)
    return f"set {ENV_VAR}={fitting.name} and rerun scripts/setup.sh (or upgrade the driver)"


# pip's words when no candidate exists for a requirement: without other constraints, and (with a constraint file,
# as some machines' pip configuration has) inside its ResolutionImpossible report
_NO_TORCH = re.compile(r"(?:No matching distribution found for|Could not find a version that satisfies the "
                       r"requirement) torch\b|no matching distributions available for your environment:\s+torch\b")


def install_failure_message(flavor: Flavor, pip_output: str) -> str:
    """Why setup stops when pip could not install `flavor`: "" unless pip's output says it found no torch wheel.

    Args:
        pip_output: what pip printed (stdout and stderr) for the flavour's requirement lines.
    """
    if not _NO_TORCH.search(pip_output):
        return ""
    wanted = next(line for line in flavor.requirements if line.startswith("torch=="))
    index = next((line.split()[-1] for line in flavor.requirements if line.startswith("--extra-index-url")), "PyPI")
    here = f"CPython {sys.version_info.major}.{sys.version_info.minor} on {platform.system()} {platform.machine()}"
    others = ", ".join(f"{ENV_VAR}={name}" for name in FLAVORS if name != flavor.name)
    unverified = ("; no wheel of this flavour has been resolved from the project's workplace (it reaches PyPI, not "
                  "download.pytorch.org)") if index != "PyPI" else ""
    return (f"pip found no wheel for {wanted} ({flavor.name} flavour) for {here} at {index}: none is published for "
            f"this Python and platform, or the index cannot be reached from here{unverified}. Choose another flavour "
            f"({others}; cu130 needs a CUDA 13 driver) or a Python that has the wheel (OMNI_PYTHON), and rerun "
            f"scripts/setup.sh")


# --- command line -------------------------------------------------------------------------------------------


def _chosen(name: str | None) -> Flavor:
    if name:
        return select_flavor(name, None)
    return select_flavor(os.environ.get(ENV_VAR), nvidia_driver())


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); returns the exit code (1 with a message on stderr on an error)."""
    parser = argparse.ArgumentParser(prog="python -m omni_backend.ops.torch_flavor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("choose", "requirements", "check", "install-failure"))
    parser.add_argument("flavor", nargs="?", help=f"a flavour name (default: {ENV_VAR}, else from the driver)")
    args = parser.parse_args(argv)
    try:
        flavor = _chosen(args.flavor)
    except ValueError as exc:
        print(f"[torch_flavor] error: {exc}", file=sys.stderr)
        return 1
    if args.command == "choose":
        print(flavor.name)
        return 0
    if args.command == "requirements":
        print("\n".join(flavor.requirements))
        return 0
    if args.command == "install-failure":  # pip's output on stdin; exit 1 with the explanation when it applies
        message = install_failure_message(flavor, sys.stdin.read())
        if message:
            print(f"[torch_flavor] error: {message}", file=sys.stderr)
        return 1 if message else 0
    try:
        facts = installed_torch()
    except ImportError as exc:
        print(f"[torch_flavor] error: torch cannot be imported ({exc})", file=sys.stderr)
        return 1
    driver = nvidia_driver()
    problems = environment_problems(flavor, facts, driver)
    for problem in problems:
        print(f"[torch_flavor] error: {problem}", file=sys.stderr)
    if problems:
        return 1
    seen = "no GPU seen by NVML" if driver is None or driver.gpus == 0 else \
        f"driver CUDA {version_text(driver.cuda)}, {driver.gpus} GPU(s)"
    print(f"[torch_flavor] torch {facts.version} (flavour {flavor.name}, CUDA {version_text(facts.cuda)}), "
          f"triton {facts.triton_installed or '(none)'}, {seen}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
