#!/usr/bin/env bash
# Serve our LLM engine behind NVIDIA Dynamo on this machine until Ctrl-C / SIGTERM: etcd, NATS, Dynamo's frontend
# (OpenAI API on port 9000, OMNI_DYNAMO_HTTP_PORT or --http-port; KV-aware routing, OMNI_DYNAMO_ROUTER_MODE or
# --router-mode round-robin for the other) and N workers (`python -m omni_backend.launch.dynamo`, default 2), each
# on free local ports. Sets up first, with the Dynamo parts (scripts/setup.sh --dynamo). The served folder:
# --model or OMNI_DYNAMO_MODEL (default the SmolLM2 checkpoint); engine settings: OMNI_<NAME> (README "Settings").
# Usage: scripts/serve_dynamo.sh [N] [--model FOLDER] [--router-mode kv|round-robin] [--http-port P] [--log-dir D]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh" --dynamo
cd "$ROOT"
export HF_HUB_OFFLINE=1
# exec: signals reach the Python launcher, which stops everything it started (workers first, etcd last).
exec "$ROOT/.venv/bin/python" -m omni_backend.launch.dynamo.local "$@"
