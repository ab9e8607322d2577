"""Lay out a runnable tritonserver folder from the `nvidia-pytriton` wheel.

The wheel ships a real Triton Inference Server 2.51 (`pytriton/tritonserver/`), Python backend stubs for
several Python versions and its shared libraries (`nvidia_pytriton.libs/`, hashed names). The layout made
here, under `<cache>/tritonserver/`:

    bin/tritonserver                         executable
    backends/python/libtriton_python.so      Python backend
    backends/python/triton_python_backend_stub   stub for this interpreter's Python version, executable
    caches/local/                            response cache
    lib/                                     every wheel library (symlinks) plus the plain names
                                             perf_analyzer needs: libb64.so.0d, libcudart.so.12
    layout.json                              what it was made from (redone when that changes)

Put `lib/` on `LD_LIBRARY_PATH` for both `tritonserver` and `perf_analyzer` (see `library_path`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import stat
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from omni_backend import paths

# Plain names perf_analyzer (tritonclient wheel) links against -> glob of the hashed file in the wheel.
PERF_ANALYZER_LIBS = {"libb64.so.0d": "libb64-*.so.0d", "libcudart.so.12": "libcudart-*.so.12*"}


@dataclass(frozen=True)
class RuntimeSource:
    """Where the wheel's server files are, and for which Python the stub is picked."""

    server_dir: str  # .../site-packages/pytriton/tritonserver
    libs_dir: str  # .../site-packages/nvidia_pytriton.libs
    pytriton_version: str
    python_version: str  # "3.11"


def find_source() -> RuntimeSource:
    """Locate the `nvidia-pytriton` files in the running environment (without importing pytriton).

    Raises:
        RuntimeError: the package is not installed or lacks the server files.
    """
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed in this environment (pip install nvidia-pytriton)")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    server_dir = package_dir / "tritonserver"
    libs_dir = package_dir.parent / "nvidia_pytriton.libs"
    if not (server_dir / "bin" / "tritonserver").is_file() or not libs_dir.is_dir():
        raise RuntimeError(f"no tritonserver binary or libraries in the nvidia-pytriton install at {package_dir}")
    return RuntimeSource(
        server_dir=str(server_dir),
        libs_dir=str(libs_dir),
        pytriton_version=importlib.metadata.version("nvidia-pytriton"),
        python_version=f"{sys.version_info.major}.{sys.version_info.minor}",
    )


def library_path(runtime: Path | None = None) -> str:
    """The `LD_LIBRARY_PATH` entry for the runtime folder's libraries (tritonserver and perf_analyzer)."""
    return str((runtime or paths.runtime_dir()) / "lib")


def tritonserver_binary(runtime: Path | None = None) -> Path:
    """Path of the laid-out `tritonserver` executable."""
    return (runtime or paths.runtime_dir()) / "bin" / "tritonserver"


def ensure_runtime(runtime: Path | None = None, log=print) -> bool:
    """Create or refresh the runtime folder; do nothing when it matches the installed wheel.

    Args:
        runtime: target folder, default `<cache>/tritonserver`.
        log: called with one line per action taken (nothing is logged when up to date).

    Returns:
        True when the folder was (re)made.

    Raises:
        RuntimeError: the wheel or the stub for this Python version is missing.
    """
    runtime = (runtime or paths.runtime_dir()).absolute()
    source = find_source()
    stamp = runtime / "layout.json"
    if stamp.is_file() and _read_json(stamp) == asdict(source) and tritonserver_binary(runtime).is_file():
        return False

    stub = Path(source.server_dir) / "python_backend_stubs" / source.python_version / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"nvidia-pytriton {source.pytriton_version} has no Python backend stub for "
                           f"Python {source.python_version}")
    log(f"[setup] laying out tritonserver runtime in {runtime}")
    staging = runtime.with_name(runtime.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source.server_dir, staging, ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
    shutil.copy2(stub, staging / "backends" / "python" / "triton_python_backend_stub")
    for executable in (staging / "bin" / "tritonserver", staging / "backends" / "python" / "triton_python_backend_stub"):
        executable.chmod(executable.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)

    lib = staging / "lib"
    lib.mkdir()
    libs_dir = Path(source.libs_dir)
    for library in sorted(libs_dir.iterdir()):
        (lib / library.name).symlink_to(library)
    for plain_name, pattern in PERF_ANALYZER_LIBS.items():
        matches = sorted(libs_dir.glob(pattern))
        if not matches:
            raise RuntimeError(f"{pattern} not found in {libs_dir}")
        (lib / plain_name).symlink_to(matches[0])

    (staging / "layout.json").write_text(json.dumps(asdict(source), indent=2) + "\n")
    shutil.rmtree(runtime, ignore_errors=True)
    staging.rename(runtime)
    return True


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
