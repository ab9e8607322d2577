#!/usr/bin/env bash
# perf_analyzer from the tritonclient wheel, with the libraries it links (libb64.so.0d, libcudart.so.12) on
# LD_LIBRARY_PATH (.cache/tritonserver/lib, laid out by setup). All arguments go to perf_analyzer; see
# perf_analyzer_configs/README.md for the omni_chat command.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LIB="${OMNI_CACHE_DIR:-$ROOT/.cache}/tritonserver/lib"
if [[ ! -e "$LIB/libb64.so.0d" ]]; then
  echo "perf_analyzer.sh: $LIB is missing; run scripts/setup.sh first" >&2
  exit 1
fi
export LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$ROOT/.venv/bin/perf_analyzer" "$@"
