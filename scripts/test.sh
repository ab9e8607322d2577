#!/usr/bin/env bash
# Set up (if needed), then run the test suite. Extra arguments go to pytest (e.g. -k chat, -m "not server").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
HF_HUB_OFFLINE=1 exec "$ROOT/.venv/bin/python" -m pytest tests "$@"
