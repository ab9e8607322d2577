#!/usr/bin/env bash
# First contact with a lent NVIDIA GPU machine: one command, under 9 minutes, with nothing but this repository
# (that machine reaches no package registry: it runs on its own python3, torch, Triton and transformers).
#
#   bash scripts/gpu_first_contact.sh
#
# Steps, each under its own time limit (20 + 390 + 65 + 55 s = 530 s at most), each runs even if an earlier
# one failed:
#   1. environment (20 s): nvidia-smi, the versions of Python, torch, its CUDA, Triton, transformers, numpy,
#      pytest-xdist and the driver, the C compiler and Python.h that Triton's launcher build needs, ncu
#      (scripts/gpu_first_contact.py environment);
#   2. scripts/gpu_check.sh (390 s): kernel tests on 8 workers with their durations, the decode kernel's bandwidth,
#      the engine's CUDA graphs against eager, the sampler;
#   3. scripts/gpu_default_start.py (65 s): one engine start with the production path (64 sequences, 2048 tokens
#      per step, 8192 context, no fixed KV size): memory profile, KV plan, graph pool, peak reserved memory,
#      decode tok/s of 64 x 128 tokens;
#   4. Nsight Compute (25 s per shape) on the paged decode kernel at the 135m and 8b shapes: DRAM % of peak,
#      occupancy (scripts/gpu_first_contact.py ncu), when ncu is there.
# On a GPU: writes benchmarks/results/gpu_check.json (every step's result, the versions next to each) and
# benchmarks/results/gpu_first_contact.log (this run's output); copies of both, and the step logs, to $OUT when
# set. Without a GPU torch can use (here, on the CPU machines) it records the environment, says what it skipped
# and exits 0, writing nothing under benchmarks/results (a GPU's record there stays as it is): only to $OUT when
# set. A GPU that nvidia-smi sees and torch cannot use is a failure (gpu_check.sh says which versions).
# Exit status: 1 when a step failed, else 0.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

first_contact() {
    source scripts/gpu_common.sh  # PY, TORCH_CUDA, step
    export PYTHON="$PY"  # gpu_check.sh uses the same interpreter
    local cuda_ok torch_version began=$SECONDS skipped=() outputs=() reason
    read -r cuda_ok torch_version _ <<<"$TORCH_CUDA"

    step environment 20 "$PY" scripts/gpu_first_contact.py environment --output "$WORK/environment.json"
    nvidia-smi 2>/dev/null || true
    GPU_CHECK_JSON="$WORK/gpu_check_sh.json" step gpu_check 390 bash scripts/gpu_check.sh
    if [[ "$cuda_ok" == 1 ]]; then
        step default_start 65 "$PY" scripts/gpu_default_start.py --output "$WORK/default_start.json"
        if "$PY" scripts/gpu_first_contact.py find-ncu; then
            step ncu 55 "$PY" scripts/gpu_first_contact.py ncu --output "$WORK/ncu.json" --timeout 25
        else
            skipped+=("ncu on the decode kernel: no Nsight Compute (ncu) on PATH or in /usr/local/cuda/bin")
        fi
    else
        reason="torch ${torch_version} sees no CUDA device"
        skipped+=("gpu_check.sh (kernel tests, decode kernel bandwidth, engine graphs vs eager, sampler): $reason"
                  "default-settings engine start (KV plan, graph pool, peak memory, decode tok/s): $reason"
                  "ncu on the decode kernel: $reason")
    fi

    if [[ "$cuda_ok" == 1 ]]; then
        outputs+=(--output benchmarks/results/gpu_check.json)
        touch "$WORK/measured_a_gpu"
    fi
    if [[ -n "${OUT:-}" ]]; then outputs+=(--output "$OUT/gpu_check.json"); fi
    local report_args=(report --work "$WORK" --gpu "$cuda_ok" "${outputs[@]}")
    for reason in "${skipped[@]}"; do report_args+=(--skipped "$reason"); done
    "$PY" scripts/gpu_first_contact.py "${report_args[@]}" > "$WORK/report.json.out" \
        || echo "gpu_first_contact.sh: the report step failed: $(tail -3 "$WORK/report.json.out")"
    echo "gpu_first_contact.sh: finished in $((SECONDS - began)) s; steps (name, exit status, seconds):"
    sed 's/^/  /' "$WORK/steps.tsv"
    for reason in "${skipped[@]}"; do echo "gpu_first_contact.sh: skipped: $reason"; done
    if [[ "${#failed[@]}" -gt 0 ]]; then
        echo "gpu_first_contact.sh: FAILED: ${failed[*]}"
        return 1
    fi
    if [[ "$cuda_ok" == 1 ]]; then
        echo "gpu_first_contact.sh: done; results in benchmarks/results/gpu_check.json and gpu_first_contact.log"
    else
        echo "gpu_first_contact.sh: done; no GPU here, so nothing was measured and nothing written under benchmarks/"
    fi
}

first_contact 2>&1 | tee "$WORK/gpu_first_contact.log"
status=${PIPESTATUS[0]}
# The pipeline ran first_contact in a subshell: it left a file saying whether a GPU was measured.
if [[ -f "$WORK/measured_a_gpu" ]]; then cp "$WORK/gpu_first_contact.log" benchmarks/results/; fi
if [[ -n "${OUT:-}" ]]; then cp "$WORK"/*.log "$WORK"/*.json "$OUT"/ 2>/dev/null || true; fi
exit "$status"
