"""scripts/gpu_check.sh and its engine step on this CPU machine: the script skips where there is no GPU, fails
loudly where a GPU is present that torch cannot use, and the engine step's code runs (on CPU, tiny)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


def test_the_engine_step_runs_its_checks_and_writes_its_report(tmp_path):
    output = tmp_path / "engine.json"
    run = subprocess.run([sys.executable, str(paths.PROJECT_ROOT / "scripts" / "gpu_check_engine.py"), "--device",
                          "cpu", "--layers", "2", "--new-tokens", "8", "--output", str(output)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(output.read_text())
    assert report["ok"] and report["device"] == "cpu"
    assert report["startup"]["fallback_reason"] == ""
    assert report["startup"]["attention_reason"].startswith("auto: CPU device")
    for name in ("graphs_vs_eager_fp32", "graphs_vs_eager_bf16"):
        assert report[name]["tokens_equal"] and report[name]["steps_compared"] == 11 * 24, report[name]
    assert set(report["decode_batch1"]["tok_per_s"]) == {"eager", "graph"}
