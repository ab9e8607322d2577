#!/usr/bin/env bash
# The C++ CPU kernels under AddressSanitizer + UndefinedBehaviorSanitizer: their tests and the CPU-engine tests that
# run them, with every library built with -fsanitize=address,undefined,float-cast-overflow into a separate
# `sanitize-address-undefined` folder inside each build folder (kernels/cpu_library.py, OMNI_KERNEL_SANITIZERS).
# Opt-in (not part of scripts/test.sh): about ten minutes on 2 cores; run it after changing a .cpp or .h of kernels/.
# Any sanitizer report fails the run: UBSan halts on its first report, ASan stops at the first bad access.
# Leak checking is off: the Python interpreter and torch keep allocations alive until exit by design.
# Extra arguments go to pytest (e.g. -k silu). Needs the venv made by scripts/setup.sh and g++ (or $CXX) with its
# sanitizer runtimes (Debian: libasan/libubsan come with g++).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CXX="${CXX:-g++}"
libasan="$("$CXX" -print-file-name=libasan.so)"
if [[ "$libasan" != /* || ! -e "$libasan" ]]; then
  echo "test_sanitizers.sh: $CXX has no AddressSanitizer runtime (libasan.so); install its sanitizer libraries" >&2
  exit 1
fi
eval "$(.venv/bin/python -m omni_backend.ops.memory_env)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 OMNI_KERNEL_SANITIZERS=address,undefined
# The ASan runtime must come first in a process that loads an instrumented library; Python itself is not
# instrumented, so it is preloaded. GLIBC_TUNABLES tune glibc's malloc, which ASan replaces.
export LD_PRELOAD="$libasan${LD_PRELOAD:+:$LD_PRELOAD}"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
unset GLIBC_TUNABLES
exec .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/kernels/test_kernels_cpu_ops.py tests/kernels/test_kernels_linear_cpu.py \
  tests/kernels/test_kernels_paged_decode_cpu.py \
  tests/engine/test_cpu_backend.py tests/engine/test_cpu_kernel_step.py "$@"
