#!/usr/bin/env python3
"""The Python half of scripts/gpu_first_contact.sh: the environment record, the Nsight Compute pass and the report.

    gpu_first_contact.py environment --output FILE   # GPUs (nvidia-smi), versions, C compiler and Python.h, ncu
    gpu_first_contact.py find-ncu                    # print where ncu is; exit 1 when there is none
    gpu_first_contact.py ncu --output FILE           # ncu on the decode kernel at the 135m and 8b shapes
    gpu_first_contact.py report --work DIR --gpu 0|1 [--output FILE]...   # one JSON from the steps' files

Standard library only at import (torch is imported where it is there): the environment step must run, and say
what it found, on a machine whose interpreter has no torch.

The Nsight Compute pass runs scripts/bench_decode_kernel.py once per shape (batch 64, context 4096, bf16, the
engine's block-table width; the benchmark's defaults, with one timed call) under `ncu`, profiling the third launch
of the split-KV kernel `_decode_partial_kernel` (the first compiles, the second warms up) for the metrics in
NCU_METRICS: DRAM throughput as % of peak, achieved and theoretical occupancy, duration, registers per thread.
Where the GPU's performance counters are not open to this user (ncu's ERR_NVGPUCTRPERM) the pass is recorded as
skipped, not failed.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from omni_backend.ops import triton_build  # noqa: E402  (standard library only)

PACKAGES = ("torch", "triton", "transformers", "numpy", "pytest", "pytest-xdist")
NCU_METRICS = {  # Nsight Compute metric -> our name
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct_of_peak",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "gpu__time_duration.sum": "duration",
    "launch__registers_per_thread": "registers_per_thread",
}
NCU_KERNEL = "_decode_partial_kernel"
NCU_SHAPES = ("135m", "8b")
# Where a CUDA toolkit or a standalone Nsight Compute puts ncu when it is not on PATH.
NCU_PLACES = ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu")


def _run(command: list[str], timeout: float = 30) -> tuple[int, str]:
    """(exit status, stdout + stderr) of a command; 127 and the error when it cannot start."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        return 127, str(exc)
    return done.returncode, done.stdout + done.stderr


def find_ncu() -> str | None:
    """`ncu` on PATH, else in NCU_PLACES; None when there is none."""
    return shutil.which("ncu") or next((place for place in NCU_PLACES if os.access(place, os.X_OK)), None)


def versions() -> dict[str, str | None]:
    """What every figure of the report was measured with: Python, the packages, torch's CUDA, the driver, the GPU."""
    found: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    try:
        import torch
        found["torch_cuda"] = torch.version.cuda
    except ImportError:
        found["torch_cuda"] = None
    status, text = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    first = text.splitlines()[0].split(", ") if status == 0 and text.strip() else [None, None]
    found["gpu"], found["driver"] = first[0], first[-1]
    return found


def environment() -> dict:
    """The machine as the checks see it (see the module docstring)."""
    status, smi = _run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,compute_cap",
                        "--format=csv,noheader"])
    gpus = [dict(zip(("index", "name", "driver", "memory", "compute_capability"), line.split(", ")))
            for line in smi.splitlines() if status == 0 and line.strip()]
    compiler = triton_build.c_compiler()
    compiler_version = _run([compiler, "--version"])[1].splitlines()[0] if compiler else None
    ncu = find_ncu()
    cuda = None
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        pass
    return {
        "versions": versions(), "python_executable": sys.executable, "cpu_cores": os.cpu_count(),
        "nvidia_smi": {"found": shutil.which("nvidia-smi") is not None, "gpus": gpus,
                       "error": None if status == 0 else smi.strip()[-500:]},
        "torch_cuda_available": cuda,
        "launcher_build": {"compiler": compiler, "compiler_version": compiler_version,
                           "python_include": triton_build.python_include_dir(),
                           "python_h": os.path.exists(os.path.join(triton_build.python_include_dir(), "Python.h")),
                           "problems": triton_build.launcher_problems()},
        "ncu": {"path": ncu, "version": _run([ncu, "--version"])[1].strip().splitlines()[-1] if ncu else None},
    }


def ncu_command(ncu: str, shape: str, log: str, bench_output: str) -> list[str]:
    """The ncu command line that profiles one `_decode_partial_kernel` launch at `shape` (module docstring)."""
    return [ncu, "--target-processes", "all", "--kernel-name", f"regex:{NCU_KERNEL}", "--launch-skip", "2",
            "--launch-count", "1", "--metrics", ",".join(NCU_METRICS), "--csv", "--log-file", log,
            sys.executable, os.path.join(ROOT, "scripts", "bench_decode_kernel.py"), "--shapes", shape,
            "--sweep-splits", "", "--warmup", "2", "--reps", "1", "--inner", "1", "--copy-mib", "16",
            "--output", bench_output]


def parse_ncu_csv(text: str) -> dict:
    """The metrics of the first profiled kernel in ncu's `--csv` output (its "==PROF==" lines skipped).

    Returns: {"kernel": name, our metric name: {"value": float, "unit": str}}; {} when no kernel was profiled.
    """
    rows = [line for line in text.splitlines() if line.startswith('"')]
    found: dict = {}
    for row in csv.DictReader(io.StringIO("\n".join(rows))):
        name = NCU_METRICS.get(row.get("Metric Name", ""))
        if name is None or found.get("kernel", row["Kernel Name"]) != row["Kernel Name"]:
            continue
        found["kernel"] = row["Kernel Name"]
        found[name] = {"value": float(row["Metric Value"].replace(",", "")), "unit": row["Metric Unit"]}
    return found


def ncu_pass(work: str, timeout_s: float) -> dict:
    """ncu at each of NCU_SHAPES: {shape: metrics or {"error"/"skipped": why}, "ok": no shape failed}."""
    ncu = find_ncu()
    result: dict = {"ncu": ncu, "kernel": NCU_KERNEL, "metrics": NCU_METRICS}
    for shape in NCU_SHAPES:
        log = os.path.join(work, f"ncu_{shape}.csv")
        command = ncu_command(ncu, shape, log, os.path.join(work, f"ncu_bench_{shape}.json"))
        status, output = _run(command, timeout_s)
        text = ""
        if os.path.exists(log):
            with open(log) as handle:
                text = handle.read()
        if "ERR_NVGPUCTRPERM" in text + output:
            result[shape] = {"skipped": "the GPU performance counters are not open to this user (ERR_NVGPUCTRPERM)"}
            continue
        metrics = parse_ncu_csv(text)
        result[shape] = metrics if metrics else {"error": f"rc={status}, no kernel profiled: {(text + output)[-1500:]}"}
    result["ok"] = not any("error" in result[shape] for shape in NCU_SHAPES)
    return result


def _load(path: str) -> dict | None:
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def report(work: str, gpu: bool, skipped: list[str]) -> dict:
    """One document from the step files in `work`: environment.json, gpu_check_sh.json (gpu_check.sh's report),
    default_start.json, ncu.json and steps.tsv ("NAME RC SECONDS" lines); each section carries the versions it was
    measured with (gpu_check.sh's its own keys)."""
    steps = {}
    if os.path.exists(os.path.join(work, "steps.tsv")):
        with open(os.path.join(work, "steps.tsv")) as handle:
            for line in handle:
                if line.strip():
                    name, rc, seconds = line.split()
                    steps[name] = {"rc": int(rc), "seconds": int(seconds), "ok": rc == "0"}
    found_versions = versions()
    doc = {"script": "scripts/gpu_first_contact.sh", "unix_time": int(time.time()), "gpu": gpu,
           "versions": found_versions, "steps": steps, "skipped": skipped,
           "failed_steps": [name for name, step in steps.items() if not step["ok"]]}
    for section, name in (("environment", "environment"), ("gpu_check", "gpu_check_sh"),
                          ("default_start", "default_start"), ("ncu", "ncu")):
        loaded = _load(os.path.join(work, f"{name}.json"))
        if loaded is not None:
            loaded.setdefault("versions", found_versions)
            doc[section] = loaded
    doc["passed"] = not doc["failed_steps"]
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("environment").add_argument("--output", required=True)
    sub.add_parser("find-ncu")
    ncu = sub.add_parser("ncu")
    ncu.add_argument("--output", required=True)
    ncu.add_argument("--timeout", type=float, default=30, help="seconds per shape")
    rep = sub.add_parser("report")
    rep.add_argument("--work", required=True, help="the folder of the steps' files")
    rep.add_argument("--gpu", type=int, choices=(0, 1), required=True, help="1: torch could use a GPU")
    rep.add_argument("--skipped", action="append", default=[], help="a step that did not run, and why")
    rep.add_argument("--output", action="append", default=[], help="where to write the report (repeatable)")
    args = ap.parse_args(argv)
    if args.command == "find-ncu":
        print(find_ncu() or "no ncu on PATH or in " + ", ".join(NCU_PLACES))
        return 0 if find_ncu() else 1
    if args.command == "report":
        doc = report(args.work, bool(args.gpu), args.skipped)
        outputs = args.output
    elif args.command == "environment":
        doc, outputs = environment(), [args.output]
    else:
        doc, outputs = ncu_pass(os.path.dirname(os.path.abspath(args.output)), args.timeout), [args.output]
    text = json.dumps(doc, indent=2)
    for path in outputs:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as handle:
            handle.write(text + "\n")
    print(text)
    return 0 if doc.get("ok", doc.get("passed", True)) else 1


if __name__ == "__main__":
    sys.exit(main())
