#!/usr/bin/env bash
# Set up (if needed), then run the test suite. Extra arguments go to pytest (e.g. -k chat, -m "not server").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# keep freed memory in-process and bound oneDNN's caches, as the server does (omni_backend/ops/memory_env.py)
exports="$("$ROOT/.venv/bin/python" -m omni_backend.ops.memory_env)"  # a failure here stops the script (set -e)
eval "$exports"
HF_HUB_OFFLINE=1 exec "$ROOT/.venv/bin/python" -m pytest tests "$@"
