#!/usr/bin/env bash
# Render the model repository from OMNI_* settings (docs/operations.md "Settings"), then run tritonserver on it.
#   OMNI_MODELS      comma-separated models to serve (default: every model of model_repository/); one stage
#                    group per deployment, e.g. "preprocess,llm,postprocess,omni_chat" (docker/k8s/)
#   OMNI_HTTP_PORT, OMNI_GRPC_PORT, OMNI_METRICS_PORT   default 8000, 8001, 8002
#   OMNI_ADMIN_KEY   the operator's key for Triton's model-repository, logging, trace and shared-memory APIs
#                    (docs/operations.md "Operator key"); unset: one is generated and printed once
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
if [[ -z "${OMNI_ADMIN_KEY:-}" ]]; then
  OMNI_ADMIN_KEY="$(python -c 'import secrets; print(secrets.token_urlsafe(24))')"
  echo "[omni] operator key for Triton's restricted APIs (header omni-admin-key): $OMNI_ADMIN_KEY"
fi
mapfile -t restricted < <(python -c 'import sys; from omni_backend.operator_key import restricted_api_flags
print("\n".join(restricted_api_flags(sys.argv[1])))' "$OMNI_ADMIN_KEY")
exec tritonserver --model-repository="$repo" \
  --http-port="${OMNI_HTTP_PORT:-8000}" --grpc-port="${OMNI_GRPC_PORT:-8001}" \
  --metrics-port="${OMNI_METRICS_PORT:-8002}" --exit-timeout-secs="${OMNI_EXIT_TIMEOUT_SECS:-30}" \
  "${restricted[@]}" "$@"
