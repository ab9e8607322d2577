"""The C++ CPU kernels' libraries: built on first use with the machine's C++ compiler, loaded through ctypes, and
the argument checks their wrappers share.

A library's file name is ``<stem>-<hash>.so`` in the build folder, where the hash covers the source, the headers
of ``kernels/`` (``*.h``), the compiler's version, the flags and the CPU's feature list (x86 ``flags``, Arm
``Features``), so a cache folder shared between machines never loads code built for another CPU. The build writes a temporary file and renames it, so
concurrent first uses (several Triton stubs) are safe. ``$CXX`` overrides the compiler (GCC 11 and later, or clang).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

COMPILE_TIMEOUT_S = 300


class CpuKernelUnavailable(RuntimeError):
    """A C++ kernel cannot be built or loaded here (no compiler, a failed or timed-out compile, an unwritable
    build folder, a library that does not load); the message says why."""


def cpu_features() -> str:
    """The CPU's feature list from /proc/cpuinfo (x86 "flags", Arm "Features"), "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build_library(source: Path, build_dir: Path, flags: list[str]) -> Path:
    """Compile `source` with `flags` into `build_dir` unless a library for this source, compiler, flags and CPU is
    there already; returns its path.

    Raises:
        CpuKernelUnavailable: as the class says.
    """
    name = os.environ.get("CXX", "g++")
    compiler = shutil.which(name)
    if compiler is None:
        raise CpuKernelUnavailable(f"no C++ compiler ({name}) on PATH")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True,
                                 timeout=60).stdout
        code = [source.read_bytes()] + [h.read_bytes() for h in sorted(Path(__file__).parent.glob("*.h"))]
        digest = hashlib.sha256(b"\0".join([*code, version.encode(), " ".join(flags).encode(),
                                            cpu_features().encode()])).hexdigest()[:16]
        path = build_dir / f"{source.stem}-{digest}.so"
        if path.exists():
            return path
        build_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=build_dir, suffix=".so.tmp")
        os.close(fd)
        try:
            done = subprocess.run([compiler, *flags, str(source), "-o", tmp], capture_output=True, text=True,
                                  timeout=COMPILE_TIMEOUT_S)
            if done.returncode != 0:
                raise CpuKernelUnavailable(f"compiling {source.name} failed:\n{done.stderr[-2000:]}")
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o755 & ~umask)  # mkstemp made it 0600: let other users of a shared cache load it
            os.replace(tmp, path)
            return path
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CpuKernelUnavailable(f"building {source.name} with {compiler} failed: {exc}") from exc


def load_functions(source: Path, build_dir: Path, flags: list[str],
                   signatures: dict[str, tuple[list, object]]) -> tuple[Path, dict[str, ctypes._CFuncPtr]]:
    """Build (`build_library`) and load `source`; returns the library's path and its functions named in
    `signatures` ({name: (argtypes, restype)}), typed.

    Raises:
        CpuKernelUnavailable: as the class says.
    """
    path = build_library(source, build_dir, flags)
    try:
        library = ctypes.CDLL(str(path))
        functions = {name: getattr(library, name) for name in signatures}
    except (OSError, AttributeError) as exc:
        raise CpuKernelUnavailable(f"loading {path} failed: {exc}") from exc
    for name, (argtypes, restype) in signatures.items():
        functions[name].argtypes = argtypes
        functions[name].restype = restype
    return path, functions


def check_float32_rows(name: str, t: torch.Tensor) -> None:
    """Raise ValueError unless `t` is a 2-D float32 CPU tensor with unit stride in its last dimension (rows of any
    stride), what the kernels' row pointers assume."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be a 2-D float32 CPU tensor with unit stride in its last dimension, got "
                         f"{t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")
