"""What docker/Dockerfile builds on, read from the file, and what NVIDIA documents about its base image (no Docker
engine here: tests/ops/test_deployment_files.py and tests/ops/test_gpu_resolve.py check the Dockerfile against this)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from omni_backend import paths
from omni_backend.ops.torch_flavor import FLAVORS, Flavor

DOCKERFILE = paths.PROJECT_ROOT / "docker" / "Dockerfile"


@dataclass(frozen=True)
class NgcRelease:
    """An NGC `nvcr.io/nvidia/tritonserver:<release>-py3` image.

    Attributes:
        triton: Triton Inference Server version inside.
        cuda: (major, minor) of the CUDA it is based on (which sets the driver it needs).
        python: the image's python3 ("3.12"), the Python its backend stub is built for.
        glibc: (major, minor) of its C library (manylinux tags its wheels may use).
    """

    triton: str
    cuda: tuple[int, int]
    python: str
    glibc: tuple[int, int]


NGC_TRITON_RELEASES = {
    # CUDA: NVIDIA's release notes, "Triton Inference Server Release 26.08 ... is based on CUDA 13.4.1".
    # Triton and Python: triton-inference-server/server branch r26.08, build.py (release_version 2.72.0, Ubuntu 24.04
    # base: ubuntu2404 CUDA repository) and docs/introduction/compatibility.md (26.08 containers: Python 3.12.3).
    # glibc: Ubuntu 24.04 ships glibc 2.39.
    "26.08": NgcRelease(triton="2.72.0", cuda=(13, 4), python="3.12", glibc=(2, 39)),
}

OLDEST_SECURE_RELEASE = (26, 6)
"""The release that fixes every Triton advisory in NVIDIA's security bulletins up to 2026-08-18 (NVIDIA/product-security:
5687 and 5691, August 2025: 25.07/25.08; 5723: 25.09; 5734: 25.10; 5790, 5816, 5828, 5848, 5853, March-July 2026: 26.01
to 26.05; 5865, 2026-08-18: CVE-2026-47606 and CVE-2026-47627..47630, "update to ... 26.06 or later")."""


def dockerfile_text() -> str:
    return DOCKERFILE.read_text()


def base_release() -> str:
    """The NGC release of the Dockerfile's FROM line ("26.08")."""
    images = re.findall(r"^FROM (\S+)", dockerfile_text(), re.M)
    assert len(images) == 1, images
    match = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d\d\.\d\d)-py3", images[0])
    assert match, f"not an NGC tritonserver -py3 image: {images[0]}"
    return match.group(1)


def torch_flavor() -> Flavor:
    """The torch flavour the Dockerfile installs by default (its OMNI_TORCH_CUDA build argument)."""
    match = re.search(r"^ARG OMNI_TORCH_CUDA=(\S+)$", dockerfile_text(), re.M)
    assert match, "docker/Dockerfile has no ARG OMNI_TORCH_CUDA=<flavour>"
    return FLAVORS[match.group(1)]
