#!/usr/bin/env bash
# NVIDIA aiperf against our OpenAI front door and against vLLM's CPU build, one server at a time (issue 15's
# setting): chat, streaming, concurrency 8, 16 requests of ~128 synthetic input tokens and 64 output tokens, EOS
# ignored. Installs aiperf==0.13.0 into .cache/bench/aiperf-venv on first use (vLLM: bench_serving.py's venv), then
# runs scripts/bench_aiperf.py, which starts and stops each server and writes benchmarks/results/aiperf.json.
#
#   scripts/bench_aiperf.sh                                   # the real run
#   scripts/bench_aiperf.sh --request-count 2 --output-tokens-mean 8 --results-dir /tmp/aiperf-smoke   # smoke
#
# Every flag goes to scripts/bench_aiperf.py (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
AIPERF_VERSION=0.13.0
AIPERF_VENV=$ROOT/.cache/bench/aiperf-venv
PYTHON=$ROOT/.venv/bin/python

if ! "$AIPERF_VENV/bin/python" -c "import aiperf" >/dev/null 2>&1 \
    || [ "$("$AIPERF_VENV/bin/python" -m pip show aiperf 2>/dev/null | sed -n 's/^Version: //p')" != "$AIPERF_VERSION" ]; then
  echo "installing aiperf==$AIPERF_VERSION into $AIPERF_VENV (log: .cache/bench/aiperf-install.log) ..."
  mkdir -p "$ROOT/.cache/bench"
  "$PYTHON" -m venv --clear "$AIPERF_VENV"
  if ! "$AIPERF_VENV/bin/python" -m pip install "aiperf==$AIPERF_VERSION" >"$ROOT/.cache/bench/aiperf-install.log" 2>&1; then
    echo "pip install aiperf==$AIPERF_VERSION failed; see .cache/bench/aiperf-install.log" >&2
    exit 1
  fi
fi

PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} exec "$PYTHON" "$ROOT/scripts/bench_aiperf.py" --aiperf "$AIPERF_VENV/bin/aiperf" "$@"
