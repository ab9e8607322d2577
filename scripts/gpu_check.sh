#!/usr/bin/env bash
# GPU checks for a lent NVIDIA GPU machine, with nothing but this repository (no converted checkpoint, no network).
#
# Uses ${PYTHON} when set, else the first of the project venv's python and python3 that imports torch
# (scripts/gpu_common.sh; a lent H200 machine's python3 has torch, triton, transformers and pytest-xdist). On a
# machine without an NVIDIA GPU it says it skipped and exits 0; where nvidia-smi sees a GPU but torch cannot use it,
# that is a failure (the install picked the wrong CUDA flavour).
#
# Steps, each under its own time limit (at most 120 + 75 + 140 + 45 s, 380 s, and the start-up); every
# step runs even if an earlier one failed, and the exit status is 1 if any failed:
#   1. pytest tests/kernels on CUDA (fp32, fp16, bf16; production head shapes included), on $GPU_CHECK_WORKERS
#      (default 8) pytest-xdist workers when xdist is there (each cold Triton compile and launcher build costs
#      seconds, and the GPU machine has 16 cores), without the files that test only the C++ CPU kernels, with the
#      25 slowest tests listed (--durations)
#   2. scripts/bench_decode_kernel.py: paged decode GB/s at the 135M and 8B head shapes, batch 64, context 4096,
#      with the engine's block-table width, against the device's measured copy bandwidth
#   3. scripts/gpu_check_engine.py: engine start-up (self-test, KV plan, graphs), CUDA graphs vs eager (fp32
#      tokens, bf16 logprobs), decode tok/s at batch 1 graph vs eager
#   4. scripts/bench_sampler.py --device cuda: the sampler at batch 64, vocabularies 49k and 128k
# Writes benchmarks/results/gpu_check.json, or $GPU_CHECK_JSON (and a copy, plus the step logs and JUnit XML, to $OUT
# when set).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# The C++ CPU kernels' tests: they need no GPU and build their libraries with the compiler (tens of seconds).
CPU_ONLY_KERNEL_TESTS=(test_kernels_cpu_ops.py test_kernels_linear_cpu.py test_kernels_paged_decode_cpu.py
                       test_kernel_sanitizer_build.py test_kernels_compile.py)

source scripts/gpu_common.sh  # PY, TORCH_CUDA, step
gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
read -r cuda_ok torch_version torch_cuda_version <<<"$TORCH_CUDA"
if [[ "$cuda_ok" != 1 ]]; then
    if [[ "${gpus:-0}" -gt 0 ]]; then
        echo "gpu_check.sh: FAILED: nvidia-smi sees ${gpus} GPU(s) but torch ${torch_version} (CUDA ${torch_cuda_version})" \
             "cannot use them; driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)" >&2
        exit 1
    fi
    echo "gpu_check.sh: skipped: no NVIDIA GPU here (torch ${torch_version}, CUDA available: no); nothing was checked"
    exit 0
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
kernel_args=(tests/kernels -q -p no:cacheprovider --confcutdir=tests/kernels --durations=25
             --junitxml "$WORK/kernels_junit.xml")
for name in "${CPU_ONLY_KERNEL_TESTS[@]}"; do kernel_args+=(--ignore "tests/kernels/$name"); done
if "$PY" -c 'import xdist' 2>/dev/null; then kernel_args+=(-n "${GPU_CHECK_WORKERS:-8}"); fi
step kernel_tests 120 "$PY" -m pytest "${kernel_args[@]}"
step decode_kernel 75 "$PY" scripts/bench_decode_kernel.py --output "$WORK/decode_kernel.json"
step engine 140 "$PY" scripts/gpu_check_engine.py --output "$WORK/engine.json"
step sampler 45 "$PY" scripts/bench_sampler.py --device cuda --output "$WORK/sampler.json"

FAILED="${failed[*]:-}" "$PY" - "$WORK" <<'PYEOF'
import json, os, subprocess, sys, time
import xml.etree.ElementTree as ET
import torch, triton

work = sys.argv[1]
report = {"unix_time": int(time.time()), "python": sys.executable, "device": torch.cuda.get_device_name(),
          "torch": torch.__version__,
          "cuda_runtime": torch.version.cuda, "triton": triton.__version__,
          "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True).stdout.strip(),
          "failed_steps": os.environ["FAILED"].split()}
try:
    suite = ET.parse(os.path.join(work, "kernels_junit.xml")).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    report["kernel_tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    cases = list(suite.iter("testcase"))
    report["kernel_tests"]["failed"] = [f"{case.get('classname')}::{case.get('name')}" for case in cases
                                        if case.find("failure") is not None or case.find("error") is not None]
    report["kernel_tests"]["seconds"] = float(suite.get("time", 0))
    slowest = sorted(cases, key=lambda case: -float(case.get("time", 0)))[:25]
    report["kernel_tests"]["slowest_s"] = {f"{case.get('classname')}::{case.get('name')}": float(case.get("time", 0))
                                           for case in slowest}
except (OSError, ET.ParseError, IndexError) as exc:
    report["kernel_tests"] = {"error": f"no JUnit report: {exc}"}
for name in ("decode_kernel", "engine", "sampler"):
    try:
        with open(os.path.join(work, f"{name}.json")) as handle:
            report[name] = json.load(handle)
    except (OSError, ValueError) as exc:
        report[name] = {"error": f"no result: {exc}"}
report["passed"] = not report["failed_steps"]
text = json.dumps(report, indent=2)
for path in (os.environ.get("GPU_CHECK_JSON") or "benchmarks/results/gpu_check.json",
             os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else ""):
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as handle:
            handle.write(text + "\n")
print(text)
PYEOF
if [[ -n "${OUT:-}" ]]; then cp "$WORK"/*.log "$WORK"/kernels_junit.xml "$OUT"/ 2>/dev/null || true; fi

if [[ "${#failed[@]}" -gt 0 ]]; then
    echo "gpu_check.sh: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check.sh: all checks passed"
