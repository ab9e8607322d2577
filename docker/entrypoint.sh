#!/usr/bin/env bash
# Render the model repository from OMNI_* settings (README "Settings"), then run tritonserver on it.
#   OMNI_MODELS      comma-separated models to serve (default: every model of model_repository/); one stage
#                    group per deployment, e.g. "preprocess,llm,postprocess,omni_chat" (docker/k8s/)
#   OMNI_HTTP_PORT, OMNI_GRPC_PORT, OMNI_METRICS_PORT   default 8000, 8001, 8002
# Arguments are passed to tritonserver (e.g. --log-verbose=1). With a first argument that is not a flag, runs
# that command instead (e.g. `python -m omni_backend.serving ...` for the OpenAI front door).
set -euo pipefail
if [[ $# -gt 0 && "$1" != -* ]]; then
  exec "$@"
fi
repo="$OMNI_CACHE_DIR/model_repository"
python - "$repo" <<'PY'
import os, sys
from omni_backend import repository
models = [m.strip() for m in os.environ.get("OMNI_MODELS", "").split(",") if m.strip()] or None
repository.render_repository(sys.argv[1], models=models)
print(f"[omni] serving {', '.join(models or repository.model_names())} from {sys.argv[1]}", flush=True)
PY
exec tritonserver --model-repository="$repo" \
  --http-port="${OMNI_HTTP_PORT:-8000}" --grpc-port="${OMNI_GRPC_PORT:-8001}" \
  --metrics-port="${OMNI_METRICS_PORT:-8002}" --exit-timeout-secs="${OMNI_EXIT_TIMEOUT_SECS:-30}" "$@"
