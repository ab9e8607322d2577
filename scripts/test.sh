#!/usr/bin/env bash
# Set up (if needed), then run the test suite. Extra arguments go to pytest (e.g. -k chat, -m "not server").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# keep freed memory in-process: page faults are very slow on this VM (omni_backend/ops/malloc.py)
export GLIBC_TUNABLES="${GLIBC_TUNABLES:-$("$ROOT/.venv/bin/python" -m omni_backend.ops.malloc)}"
HF_HUB_OFFLINE=1 exec "$ROOT/.venv/bin/python" -m pytest tests "$@"
