#!/usr/bin/env bash
# GPU checks for a lent NVIDIA GPU machine (H200) with the repository copied in.
#
# Assumes torch and triton with CUDA are importable by ${PYTHON:-python3}; installs pytest if it is
# missing (needs a package index or PIP_FIND_LINKS with a wheel, since the machine may be offline).
# Steps (total well under 8 minutes):
#   1. pytest tests/kernels on CUDA, without the Triton interpreter (fp32, fp16 and bf16).
#   2. scripts/bench_decode_kernel.py: paged decode, batch 64 x context 4096, 8B-like heads, bf16;
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

echo "== kernel tests (CUDA) =="
timeout 270 "$PY" -m pytest tests/kernels -q -p no:cacheprovider

echo "== paged decode benchmark =="
timeout 90 "$PY" scripts/bench_decode_kernel.py

# engine checks
if [ -d tests/engine ]; then
    echo "== engine GPU tests =="
    # exit status 5 = no tests collected, which is fine
    timeout 90 "$PY" -m pytest tests/engine -m gpu -q -p no:cacheprovider || [ $? -eq 5 ]
fi

echo "gpu_check.sh: all checks passed"
