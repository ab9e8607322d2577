#!/usr/bin/env bash
# Set up (if needed), then serve the omni_chat pipeline with tritonserver until Ctrl-C / SIGTERM.
# Flags: --http-port N --grpc-port N --metrics-port N (env: OMNI_HTTP_PORT, OMNI_GRPC_PORT, OMNI_METRICS_PORT).
# The OpenAI-compatible front door starts beside it: --openai-port N (env OMNI_OPENAI_PORT, default 9000; 0: off);
# its other settings (OMNI_API_KEY, body and concurrency limits) are in omni_backend/serving/config.py.
# Model settings: OMNI_MAX_MODEL_LEN, OMNI_KV_CACHE_BYTES, ... (README "Settings").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1
# exec: signals reach the Python launcher, which stops everything it started.
exec "$ROOT/.venv/bin/python" -m omni_backend.launch "$@"
