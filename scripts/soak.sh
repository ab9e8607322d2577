#!/usr/bin/env bash
# Soak test: set up (if needed), start tritonserver + the OpenAI front door on free ports, run a warm-up and then
# --minutes (default 10) of mixed traffic at --concurrency (default 8): chat, streamed chat, streamed chat cut
# off at a random point, completions. Reports errors by kind and the RSS growth of every process (tritonserver,
# each Python-backend stub by model, the front door); writes benchmarks/results/soak.json.
# Exit code 1 when there was any error or a process grew its RSS by 5 % or more (2: the stack did not start).
# Flags: --minutes M --warmup-minutes M --concurrency N --sample-s S --seed N --kinds K,K --out FILE (scripts/soak.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1
exec "$ROOT/.venv/bin/python" "$ROOT/scripts/soak.py" "$@"
