"""Whether OpenAI Triton can build its kernel launchers here: a C compiler and the interpreter's `Python.h`.

On a GPU, Triton compiles a small C launcher per kernel signature the first time it runs one
(triton/runtime/build.py, `_build` in Triton 3.6 and 3.7): with `$CC`, else `gcc`, else `clang`, against the include
folder of the running interpreter (`sysconfig.get_paths()["include"]`, Debian's "posix_local" scheme read as
"posix_prefix", as Triton does). Without either, the first kernel launch fails; the engine's start-up self-test
would catch it, and an automatic attention choice would then serve torch eager without CUDA graphs behind one
WARNING. So scripts/setup.sh checks both on a GPU machine (this module's `main`), and the attention selector
(engine/attention/selector.py) checks them before any kernel runs: an explicit `triton` is refused with this
module's message, `auto` falls back to torch with it as a WARNING and in `omni_runtime_info{fallback_reason}`. A
launcher already in Triton's cache would not need the compiler; the check does not rely on one. The Triton
interpreter (TRITON_INTERPRET=1, CPU) builds nothing.

    python -m omni_backend.ops.triton_build    # exit 1 naming what is missing and how to install it

Standard library only: setup runs it with nothing else assumed.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

COMPILE_TIMEOUT_S = 60


def c_compiler() -> str | None:
    """The compiler Triton would use: `$CC` when set (a name on PATH or a path; Triton takes even an empty one),
    else gcc, else clang; None when that one is not there."""
    requested = os.environ.get("CC")
    if requested is not None:
        return shutil.which(requested) if requested else None
    return shutil.which("gcc") or shutil.which("clang")


def python_include_dir() -> str:
    """The folder Triton takes Python.h from: the running interpreter's include path."""
    scheme = sysconfig.get_default_scheme()
    return sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]


def launcher_problems(compiler: str | None = None, include_dir: str | None = None) -> list[str]:
    """What stops Triton's launcher build here (empty when nothing does): no C compiler, no Python.h, or a compiler
    that cannot compile `#include <Python.h>` (syntax only, a fraction of a second).

    Args:
        compiler, include_dir: the compiler and include folder to check (default: `c_compiler()`,
            `python_include_dir()`).
    """
    compiler = compiler if compiler is not None else c_compiler()
    include_dir = include_dir if include_dir is not None else python_include_dir()
    problems = []
    if compiler is None:
        wanted = f"$CC={os.environ['CC']}" if "CC" in os.environ else "gcc or clang"
        problems.append(f"no C compiler on PATH ({wanted})")
    header = os.path.join(include_dir, "Python.h")
    if not os.path.exists(header):
        problems.append(f"no {header} (the Python {sys.version_info.major}.{sys.version_info.minor} headers)")
    if not problems:
        with tempfile.TemporaryDirectory() as folder:
            source = os.path.join(folder, "probe.c")
            with open(source, "w") as handle:
                handle.write("#include <Python.h>\n")
            try:
                done = subprocess.run([compiler, "-fsyntax-only", f"-I{include_dir}", source], capture_output=True,
                                      text=True, timeout=COMPILE_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as exc:
                problems.append(f"{compiler} cannot run: {exc}")
            else:
                if done.returncode != 0:
                    problems.append(f"{compiler} cannot compile against {header}: {done.stderr.strip()[-500:]}")
    return problems


@functools.lru_cache(maxsize=1)
def launcher_problems_here() -> tuple[str, ...]:
    """`launcher_problems()` for this process, checked once."""
    return tuple(launcher_problems())


def install_hint(os_release: str | None = None) -> str:
    """How to install a C compiler and this Python's headers, as a sentence, by distribution (/etc/os-release's ID
    and ID_LIKE: Debian/Ubuntu apt-get, Fedora/RHEL dnf, else a description of what to install).

    Args:
        os_release: the file's text (default: read /etc/os-release; unknown when unreadable).
    """
    if os_release is None:
        try:
            with open("/etc/os-release") as handle:
                os_release = handle.read()
        except OSError:
            os_release = ""
    ids = set()
    for line in os_release.splitlines():
        key, _, value = line.partition("=")
        if key in ("ID", "ID_LIKE"):
            ids.update(value.strip().strip('"').split())
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if ids & {"debian", "ubuntu"}:
        return f"Install them with `apt-get install -y gcc python{version}-dev` (as root)"
    if ids & {"fedora", "rhel", "centos"}:
        return f"Install them with `dnf install -y gcc python{version}-devel` (as root)"
    return (f"Install a C compiler (gcc or clang) and the development headers of Python {version} (Python.h in "
            f"{python_include_dir()})")


def problem_message(problems: list[str] | tuple[str, ...], os_release: str | None = None) -> str:
    """One sentence for the log or an error: what stops the launcher build and how to install what is missing."""
    return (f"Triton cannot build its GPU kernel launchers here: {'; '.join(problems)}. "
            f"{install_hint(os_release)}.")


def main() -> int:
    """Setup's check: exit 0 (and one line) when the launcher can be built, else 1 with `problem_message`."""
    problems = launcher_problems_here()
    if not problems:
        print(f"[triton_build] C compiler {c_compiler()} and {python_include_dir()}/Python.h: ok")
        return 0
    print(f"[triton_build] error: {problem_message(problems)} Then rerun scripts/setup.sh.", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
