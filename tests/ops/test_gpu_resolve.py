"""The GPU requirement sets resolve from PyPI alone, as a GPU machine's setup and the Docker build would resolve them.

Each resolve is `pip install --dry-run --report` of torch_flavor's lines plus requirements.txt, wheels only, for
manylinux x86_64 up to the target's glibc and the target's CPython version, from https://pypi.org/simple with pip's
configuration ignored (so this machine's local CPU torch wheel and extra indexes are not seen). Targets: a GPU machine
like this one (this Python and glibc, flavour cu130: PyPI's CUDA 13.0 torch) and the Docker image (its base's Python
and glibc, tests/helpers/docker_image.py, and the Dockerfile's flavour).

`--use-feature=fast-deps`: this workplace's index pages do not advertise PEP 658 metadata (the .metadata files
exist but the links lack the attribute), so plain pip downloads every wheel, about 3 GB with torch's CUDA
libraries; fast-deps reads each wheel's metadata with HTTP range requests and, with --dry-run, downloads none.
Measured here (2026-12-01, pip 26.3, 2 shared cores): 20 s for the GPU machine's set and 26 s for the Docker
image's one after the other; run at once, as below, both take 26-32 s.

pip evaluates environment markers with the running interpreter, not with --python-version, so each resolve reads
requirements.txt with its markers already evaluated for the target (`target_requirements`), as pip on the target's
Python would read it. The markers of torch's own requirements are evaluated for this Python: they hold alike for
3.11 and 3.12 (platform_system == "Linux", python_version < "3.15").
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from helpers import docker_image
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from omni_backend import paths
from omni_backend.ops.torch_flavor import FLAVORS, TORCH_VERSION

REQUIREMENTS = paths.PROJECT_ROOT / "requirements.txt"


def target_environment(python: str) -> dict[str, str]:
    """Marker variables of a Linux x86_64 CPython `python` ("3.12")."""
    return {"python_version": python, "platform_system": "Linux", "sys_platform": "linux",
            "platform_machine": "x86_64", "implementation_name": "cpython", "os_name": "posix"}


def target_requirements(python: str) -> list[Requirement]:
    """requirements.txt's requirements whose markers hold on `python` (markers dropped from the result)."""
    selected = []
    for line in REQUIREMENTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(target_environment(python)):
                requirement.marker = None
                selected.append(requirement)
    return selected


def resolve_command(python: str, glibc: tuple[int, int], report: str, requirement_files: list[str]) -> list[str]:
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(glibc[1], 4, -1)] + ["manylinux2014_x86_64"]
    files = [arg for name in requirement_files for arg in ("-r", name)]
    return [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", report, "--ignore-installed",
            "--use-feature=fast-deps", "--only-binary=:all:", *(f"--platform={p}" for p in platforms),
            f"--python-version={python}", "--implementation=cp", "--index-url=https://pypi.org/simple", *files]


def pip_environment() -> dict[str, str]:
    """This environment without pip's configuration (files and PIP_* variables), keeping the TLS trust store."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


TARGETS = {
    "gpu machine": (FLAVORS["cu130"], f"{sys.version_info.major}.{sys.version_info.minor}",
                    tuple(int(p) for p in platform.libc_ver()[1].split(".")[:2])),
    "docker image": (docker_image.torch_flavor(),
                     docker_image.NGC_TRITON_RELEASES[docker_image.base_release()].python,
                     docker_image.NGC_TRITON_RELEASES[docker_image.base_release()].glibc),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    """Both resolves, run at once: target name -> pip's installation report (pip's stderr on failure)."""
    pinned_pip = next(line.split("==")[1] for line in REQUIREMENTS.read_text().splitlines()
                      if line.startswith("pip=="))
    if importlib.metadata.version("pip") != pinned_pip:
        pytest.fail(f"pip {importlib.metadata.version('pip')} here, requirements.txt pins {pinned_pip} "
                    "(fast-deps dry runs without downloads): run scripts/setup.sh")
    folder = tmp_path_factory.mktemp("resolve")

    def run(name: str) -> dict:
        flavor, python, glibc = TARGETS[name]
        stem = name.replace(" ", "-")
        torch_lines = folder / f"{stem}-torch.txt"
        torch_lines.write_text("\n".join(flavor.requirements) + "\n")
        requirements = folder / f"{stem}-requirements.txt"
        requirements.write_text("".join(f"{r}\n" for r in target_requirements(python)))
        report = folder / f"{stem}.json"
        done = subprocess.run(resolve_command(python, glibc, str(report), [str(torch_lines), str(requirements)]),
                              env=pip_environment(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
        return json.loads(report.read_text())

    with ThreadPoolExecutor(len(TARGETS)) as pool:
        return dict(zip(TARGETS, pool.map(run, TARGETS)))


def installs(report: dict) -> dict[str, dict]:
    return {canonicalize_name(item["metadata"]["name"]): item for item in report["install"]}


@pytest.mark.parametrize("target", TARGETS)
def test_resolves_to_torch_and_the_triton_that_torch_declares(reports, target):
    flavor, python, _ = TARGETS[target]
    packages = installs(reports[target])
    torch = packages["torch"]["metadata"]
    assert torch["version"].split("+")[0] == TORCH_VERSION
    declared = [Requirement(line) for line in torch["requires_dist"]]
    triton_pins = [str(r.specifier) for r in declared
                   if r.name == "triton" and (r.marker is None or r.marker.evaluate(target_environment(python)))]
    assert triton_pins == [f"=={packages['triton']['metadata']['version']}"], triton_pins
    # the CUDA of the torch that resolved is the flavour's: cuda-toolkit X.Y.* on PyPI's builds
    toolkit = [r for r in declared if r.name == "cuda-toolkit"]
    assert toolkit and str(toolkit[0].specifier).startswith(f"=={flavor.cuda[0]}.{flavor.cuda[1]}."), toolkit


def test_the_cpu_flavour_pins_the_triton_the_cuda_build_declares(reports):
    """So CPU interpreter tests run the OpenAI Triton a GPU machine runs."""
    assert FLAVORS["cpu"].triton_pin == installs(reports["gpu machine"])["triton"]["metadata"]["version"]


@pytest.mark.parametrize("target", TARGETS)
def test_every_package_is_a_wheel_from_pypi(reports, target):
    urls = [item["download_info"]["url"] for item in reports[target]["install"]]
    assert urls and all(u.startswith("https://files.pythonhosted.org/") and u.endswith(".whl") for u in urls), \
        [u for u in urls if not u.endswith(".whl")]


@pytest.mark.parametrize("target", TARGETS)
def test_every_requirement_is_pinned_and_resolved_at_its_pin(reports, target):
    packages = installs(reports[target])
    for requirement in target_requirements(TARGETS[target][1]):
        pins = [s.version for s in requirement.specifier if s.operator == "=="]
        assert len(pins) == 1, f"{requirement}: pin one version"
        assert packages[canonicalize_name(requirement.name)]["metadata"]["version"] == pins[0], requirement


def test_python_specific_pins_differ_only_where_a_wheel_demands_it():
    """The 3.11 and 3.12 sets differ only in the Triton client and what it constrains (requirements.txt says why)."""
    pins = {python: {canonicalize_name(r.name): str(r.specifier) for r in target_requirements(python)}
            for python in ("3.11", "3.12")}
    differing = {name for name in pins["3.11"] if pins["3.11"][name] != pins["3.12"].get(name)}
    assert differing == {"tritonclient", "geventhttpclient", "grpcio", "protobuf"}
    assert pins["3.11"]["tritonclient"] == "==2.51.0" and pins["3.12"]["tritonclient"] == "==2.52.0"
