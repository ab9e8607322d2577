#!/usr/bin/env bash
# Set up (if needed), then run the test suite. Extra arguments go to pytest (e.g. -k chat, -m "not server").
# Without arguments, the README smoke step follows: every command of README.md run against a fresh
# scripts/serve.sh on free ports (scripts/readme_smoke.py, about a minute).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# keep freed memory in-process and bound oneDNN's caches, as the server does (omni_backend/ops/memory_env.py)
exports="$("$ROOT/.venv/bin/python" -m omni_backend.ops.memory_env)"  # a failure here stops the script (set -e)
eval "$exports"
export HF_HUB_OFFLINE=1
if [ "$#" -gt 0 ]; then
  exec "$ROOT/.venv/bin/python" -m pytest tests "$@"
fi
"$ROOT/.venv/bin/python" -m pytest tests
exec "$ROOT/.venv/bin/python" "$ROOT/scripts/readme_smoke.py"
