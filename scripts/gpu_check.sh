#!/usr/bin/env bash
# GPU checks for a lent NVIDIA GPU machine (H200) with the repository copied in.
#
# Assumes torch and triton with CUDA are importable by ${PYTHON:-python3}; installs pytest if it is
# missing (needs a package index or PIP_FIND_LINKS with a wheel, since the machine may be offline).
# Steps (at most 270 + 90 + 90 s, under 8 minutes); every step runs even if an earlier one fails,
# and the exit status is non-zero if any failed:
#   1. pytest tests/kernels on CUDA, without the Triton interpreter (fp32, fp16 and bf16);
#      JUnit XML to $OUT/kernels_junit.xml when OUT is set.
#   2. scripts/bench_decode_kernel.py: paged decode at SmolLM2-135M's and an 8B model's heads, batch 64 x
#      context 4096 in 8192-token block tables, bf16, against the measured copy bandwidth;
#      JSON to $OUT/gpu_check.json if OUT is set, else benchmarks/results/gpu_check.json.
#   3. engine checks (below the "# engine checks" marker).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
unset TRITON_INTERPRET

"$PY" - <<'PYEOF'
import sys
import torch, triton
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: torch sees no CUDA device; this script is for a GPU machine")
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
PYEOF

if ! "$PY" -m pytest --version >/dev/null 2>&1; then
    "$PY" -m pip install --quiet pytest || { echo "gpu_check.sh: cannot install pytest" >&2; exit 1; }
fi

failed=()
step() {  # step NAME COMMAND...: run, report, remember failures
    local name=$1 rc=0
    shift
    echo "== $name =="
    "$@" || rc=$?
    if [ "$rc" -eq 0 ]; then echo "-- $name: ok"; else echo "-- $name: FAILED (rc=$rc)"; failed+=("$name"); fi
}

junit=()
if [ -n "${OUT:-}" ]; then junit=(--junitxml "$OUT/kernels_junit.xml"); fi
# --confcutdir: only tests/kernels/conftest.py, not the server fixtures in tests/conftest.py
step "kernel tests (CUDA)" timeout 270 "$PY" -m pytest tests/kernels -q -p no:cacheprovider \
    --confcutdir=tests/kernels "${junit[@]}"

step "paged decode benchmark" timeout 90 "$PY" scripts/bench_decode_kernel.py

# engine checks
engine_gpu_tests() {
    local rc=0
    timeout 90 "$PY" -m pytest tests/engine -m gpu -q -p no:cacheprovider || rc=$?
    [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ]  # 5 = no test collected
}
if [ -d tests/engine ]; then
    step "engine GPU tests" engine_gpu_tests
fi

if [ "${#failed[@]}" -gt 0 ]; then
    echo "gpu_check.sh: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check.sh: all checks passed"
