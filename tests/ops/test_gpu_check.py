"""scripts/gpu_check.sh and its engine step on this CPU machine: the script skips where there is no GPU, fails
loudly where a GPU is present that torch cannot use, and the engine step's code runs (on CPU, tiny)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import torch

from omni_backend import paths

SCRIPT = paths.PROJECT_ROOT / "scripts" / "gpu_check.sh"


def _run(env_extra: dict | None = None, path_prefix: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, **(env_extra or {})}
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def test_without_a_gpu_it_says_it_skipped_and_exits_0():
    run = _run()
    assert run.returncode == 0, run.stderr
    assert "gpu_check.sh: skipped: no NVIDIA GPU here" in run.stdout


def test_a_gpu_that_torch_cannot_use_is_a_failure(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\ncase "$*" in *driver_version*) echo 535.104.05;; '
                    '*) echo "GPU 0: NVIDIA H200 (UUID: GPU-0)";; esac\n')
    fake.chmod(0o755)
    run = _run(path_prefix=str(tmp_path))
    assert run.returncode == 1
    assert "nvidia-smi sees 1 GPU(s) but torch" in run.stderr and "cannot use them; driver: 535.104.05" in run.stderr


def test_a_half_made_venv_without_torch_is_passed_over_for_a_python_that_imports_torch(tmp_path):
    (tmp_path / "scripts").mkdir()
    for name in ("gpu_check.sh", "gpu_common.sh"):
        shutil.copy(SCRIPT.parent / name, tmp_path / "scripts" / name)
    venv_python = tmp_path / ".venv" / "bin" / "python"  # what a failed offline setup leaves: python, no torch
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(f'#!/bin/sh\nexec {sys.executable} -S -c "import sys; sys.path[:] = []; import torch"\n')
    venv_python.chmod(0o755)
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # the machine's python, with torch
    (tools / "python3").chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "PYTHON"}
    env["PATH"] = f"{tools}:{env['PATH']}"
    run = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[:3] == [
        "gpu_check.sh: .venv/bin/python cannot import torch; not using it",
        "gpu_check.sh: python: python3",
        f"gpu_check.sh: skipped: no NVIDIA GPU here (torch {torch.__version__}, CUDA available: no); nothing was "
        "checked"]


def _cpu_smoke_run(script: str, output) -> dict:
    """Run a GPU check script on CPU with a 2-layer model and 8 new tokens; its JSON report."""
    run = subprocess.run([sys.executable, str(paths.PROJECT_ROOT / "scripts" / script), "--device", "cpu",
                          "--layers", "2", "--new-tokens", "8", "--output", str(output)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(output.read_text())


def test_the_engine_step_runs_its_checks_and_writes_its_report(tmp_path):
    report = _cpu_smoke_run("gpu_check_engine.py", tmp_path / "engine.json")
    assert report["ok"] and report["device"] == "cpu"
    assert report["startup"]["fallback_reason"] == ""
    assert report["startup"]["attention_reason"].startswith("auto: CPU device")
    for name in ("graphs_vs_eager_fp32", "graphs_vs_eager_bf16"):
        assert report[name]["tokens_equal"] and report[name]["steps_compared"] == 11 * 24, report[name]
    assert set(report["decode_batch1"]["tok_per_s"]) == {"eager", "graph"}


def test_the_default_settings_start_records_its_kv_plan_and_decode_speed(tmp_path):
    report = _cpu_smoke_run("gpu_default_start.py", tmp_path / "default_start.json")
    startup = report["startup"]
    assert startup["settings"] == {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_model_len": 8192,
                                   "gpu_memory_utilization": 0.75, "block_size": 16, "kv_cache_bytes": 0}
    # CPU: no profile, no graphs; bfloat16 (this CPU's auto dtype) blocks of 2 (K, V) x 2 layers x 16 x 3 x 64 x 2 B
    assert (startup["memory_profile_bytes"], startup["graph_pool_bytes"], startup["graph_batch_sizes"]) == (None, 0, [])
    block = 2 * 2 * 16 * 3 * 64 * torch.empty((), dtype=getattr(torch, startup["dtype"][6:])).element_size()
    assert startup["kv_plan"] == {"num_blocks": (512 << 20) // block, "block_bytes": block,
                                  "bytes": (512 << 20) // block * block, "tokens": (512 << 20) // block * 16,
                                  "reason": "CPU default (512 MiB)"}
    decode = report["decode"]
    assert (decode["prompt_tokens"], decode["generated"], decode["decode_steps"], decode["ok"]) == (
        64 * 16, 64 * 8, 7, True)  # 64 prompts of 16 tokens in the first step, then 7 decode steps
    assert decode["decode_tok_per_s"] > 0 and report["versions"]["torch"] == torch.__version__
