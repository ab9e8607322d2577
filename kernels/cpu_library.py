"""The C++ CPU kernels' libraries: built on first use with the machine's C++ compiler, loaded through ctypes, and
the argument checks their wrappers share.

A library's file name is ``<stem>-<hash>.so`` in the build folder, where the hash covers the source, the headers
of ``kernels/`` (``*.h``), the compiler's version, the flags and the CPU's feature list (x86 ``flags``, Arm
``Features``), so a cache folder shared between machines never loads code built for another CPU. The build writes a temporary file and renames it, so
concurrent first uses (several Triton stubs) are safe. ``$CXX`` overrides the compiler (GCC 11 and later, or clang).

``$OMNI_KERNEL_SANITIZERS`` (``address``, ``undefined`` or both, comma-separated; a developer's switch, not a
serving setting) builds every library with those sanitizers into a ``sanitize-<kinds>`` folder inside the build
folder, never beside the production builds; ``scripts/test_sanitizers.sh`` sets it, with the AddressSanitizer
runtime preloaded, which a library built with ``address`` needs in a Python process.
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
SANITIZERS_ENV = "OMNI_KERNEL_SANITIZERS"
SANITIZERS = ("address", "undefined")


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


def sanitizer_build(value: str) -> tuple[list[str], str]:
    """The extra compiler flags and the build subfolder for an `OMNI_KERNEL_SANITIZERS` value ("" for none).

    ``undefined`` adds ``float-cast-overflow`` (a NaN or out-of-range float cast to an integer), which GCC's
    ``-fsanitize=undefined`` leaves out. Frame pointers and debug lines make the reports' stacks readable.

    Raises:
        CpuKernelUnavailable: a kind outside SANITIZERS, or ``address`` in a process without the AddressSanitizer
            runtime loaded first (loading the library would abort the process).
    """
    kinds = sorted({kind.strip() for kind in value.split(",") if kind.strip()})
    if not kinds:
        return [], ""
    unknown = [kind for kind in kinds if kind not in SANITIZERS]
    if unknown:
        raise CpuKernelUnavailable(f"{SANITIZERS_ENV}={value!r}: unknown sanitizer {unknown[0]!r}; choose from "
                                   f"{', '.join(SANITIZERS)}")
    if "address" in kinds and not _asan_runtime_loaded():
        raise CpuKernelUnavailable(f"{SANITIZERS_ENV}={value!r} needs the AddressSanitizer runtime preloaded "
                                   "(LD_PRELOAD=$(g++ -print-file-name=libasan.so)); scripts/test_sanitizers.sh "
                                   "does that")
    checks = kinds + (["float-cast-overflow"] if "undefined" in kinds else [])
    return [f"-fsanitize={','.join(checks)}", "-fno-omit-frame-pointer", "-g"], "sanitize-" + "-".join(kinds)


def _asan_runtime_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return "libasan" in maps.read()
    except OSError:
        return False


def build_library(source: Path, build_dir: Path, flags: list[str]) -> Path:
    """Compile `source` with `flags` into `build_dir` unless a library for this source, compiler, flags and CPU is
    there already; returns its path. With `OMNI_KERNEL_SANITIZERS` set, the sanitizer flags are added and the
    library goes to a subfolder of `build_dir` (`sanitizer_build`).

    Raises:
        CpuKernelUnavailable: as the class says.
    """
    extra, subfolder = sanitizer_build(os.environ.get(SANITIZERS_ENV, ""))
    if subfolder:
        build_dir, flags = build_dir / subfolder, [*flags, *extra]
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


class CpuLibrary:
    """A C++ kernel library, built on first use (`load_functions`) and called through ctypes. A subclass names its
    ``SOURCE`` (a .cpp beside this file), its compiler ``FLAGS`` and the ``SIGNATURES`` of its entry points
    ({name: (argtypes, restype)}).

    Args:
        build_dir: folder for the compiled library (created if missing).

    Attributes:
        path: the loaded library's file.

    Raises:
        CpuKernelUnavailable: the library cannot be built or loaded here (the message says why).
    """

    SOURCE: Path
    FLAGS: list[str]
    SIGNATURES: dict[str, tuple[list, object]]

    def __init__(self, build_dir: str | os.PathLike):
        self.path, self._fn = load_functions(self.SOURCE, Path(build_dir), self.FLAGS, self.SIGNATURES)

    def entry_point(self, name: str) -> ctypes._CFuncPtr:
        """The typed ctypes function `name` (a key of ``SIGNATURES``), for callers in C (kernels/cpu_decode_step).

        Raises:
            KeyError: `name` is not one of the library's entry points.
        """
        return self._fn[name]


def check_cpu_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Raise ValueError unless `t` is a contiguous CPU tensor of `dtype` and `shape`."""
    if t.dtype != dtype or t.device.type != "cpu" or tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor of shape {tuple(shape)}, got {t.dtype} "
                         f"{tuple(t.shape)} strides {t.stride()} on {t.device}")


def check_float32_rows(name: str, t: torch.Tensor) -> None:
    """Raise ValueError unless `t` is a 2-D float32 CPU tensor whose rows are each contiguous and do not overlap
    (unit stride in the last dimension, row stride at least the row's length), what the kernels' row pointers
    assume."""
    rows, width = t.shape if t.dim() == 2 else (0, 0)
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2 or (width > 1 and t.stride(1) != 1) \
            or (rows > 1 and t.stride(0) < width):
        raise ValueError(f"{name} must be a 2-D float32 CPU tensor of contiguous, non-overlapping rows, got "
                         f"{t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")


def check_disjoint(written: str, a: torch.Tensor, read: str, b: torch.Tensor) -> None:
    """Raise ValueError if the memory `a` spans (from its first to its last element) overlaps `b`'s: a kernel
    writing `a` while reading `b` would read values it has already overwritten."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    if a.numel() and b.numel():
        (a0, a1), (b0, b1) = span(a), span(b)
        if a0 < b1 and b0 < a1:
            raise ValueError(f"{written} overlaps {read} in memory; the kernel writes one while reading the other")
