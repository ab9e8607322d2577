"""scripts/gpu_first_contact.sh on this CPU machine (it records the environment, says what it skipped, exits 0 and
writes nothing under benchmarks/), and its Python half: ncu's CSV read back, the ncu pass against a stand-in ncu
(metrics, counters not permitted), and the report built from the steps' files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from omni_backend import paths

SCRIPTS = paths.PROJECT_ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
import gpu_first_contact  # noqa: E402

# ncu --csv --log-file output for one profiled launch (the layout of Nsight Compute 2025's "details" page; a second
# kernel's row must not mix in).
NCU_CSV = """==PROF== Connected to process 4242 (/usr/bin/python3.12)
==PROF== Profiling "_decode_partial_kernel": 0%....50%....100% - 3 passes
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3.12","127.0.0.1","_decode_partial_kernel","1","7","(128, 1, 1)","(2, 3, 64)","0","9.0","Command line profiler metrics","dram__throughput.avg.pct_of_peak_sustained_elapsed","%","71.42"
"0","4242","python3.12","127.0.0.1","_decode_partial_kernel","1","7","(128, 1, 1)","(2, 3, 64)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","1,234.50"
"0","4242","python3.12","127.0.0.1","_decode_partial_kernel","1","7","(128, 1, 1)","(2, 3, 64)","0","9.0","Command line profiler metrics","launch__registers_per_thread","register/thread","96"
"0","4242","python3.12","127.0.0.1","_decode_partial_kernel","1","7","(128, 1, 1)","(2, 3, 64)","0","9.0","Command line profiler metrics","sm__maximum_warps_per_active_cycle_pct","%","50"
"0","4242","python3.12","127.0.0.1","_decode_partial_kernel","1","7","(128, 1, 1)","(2, 3, 64)","0","9.0","Command line profiler metrics","sm__warps_active.avg.pct_of_peak_sustained_active","%","38.7"
"1","4242","python3.12","127.0.0.1","_decode_reduce_kernel","1","7","(64, 1, 1)","(3, 64, 1)","0","9.0","Command line profiler metrics","dram__throughput.avg.pct_of_peak_sustained_elapsed","%","5.1"
==PROF== Disconnected from process 4242
"""
PARSED = {"kernel": "_decode_partial_kernel",
          "dram_pct_of_peak": {"value": 71.42, "unit": "%"},
          "duration": {"value": 1234.5, "unit": "usecond"},
          "registers_per_thread": {"value": 96.0, "unit": "register/thread"},
          "theoretical_occupancy_pct": {"value": 50.0, "unit": "%"},
          "achieved_occupancy_pct": {"value": 38.7, "unit": "%"}}


def test_on_this_cpu_machine_it_records_the_environment_says_what_it_skipped_and_exits_0(tmp_path):
    record = paths.PROJECT_ROOT / "benchmarks" / "results" / "gpu_check.json"
    before = record.stat().st_mtime_ns if record.exists() else None
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(SCRIPTS / "gpu_first_contact.sh")], env=env, capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    reason = f"torch {torch.__version__} sees no CUDA device"
    skipped = [f"gpu_check.sh (kernel tests, decode kernel bandwidth, engine graphs vs eager, sampler): {reason}",
               f"default-settings engine start (KV plan, graph pool, peak memory, decode tok/s): {reason}",
               f"ncu on the decode kernel: {reason}"]
    for line in skipped:
        assert f"gpu_first_contact.sh: skipped: {line}\n" in run.stdout
    assert run.stdout.endswith("gpu_first_contact.sh: done; no GPU here, so nothing was measured and nothing "
                               "written under benchmarks/\n")
    assert (record.stat().st_mtime_ns if record.exists() else None) == before  # a GPU's record stays
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (report["gpu"], report["passed"], report["skipped"], report["failed_steps"]) == (False, True, skipped, [])
    assert set(report["steps"]) == {"environment", "gpu_check"} and report["steps"]["gpu_check"]["ok"]
    environment = report["environment"]
    assert environment["versions"]["torch"] == torch.__version__ and environment["torch_cuda_available"] is False
    assert environment["launcher_build"]["python_h"] and environment["launcher_build"]["problems"] == []
    assert "gpu_check.sh: skipped: no NVIDIA GPU here" in (tmp_path / "gpu_first_contact.log").read_text()


def test_ncu_csv_is_read_for_the_first_profiled_kernel_only():
    assert gpu_first_contact.parse_ncu_csv(NCU_CSV) == PARSED
    assert gpu_first_contact.parse_ncu_csv("==PROF== No kernels were profiled.\n") == {}


@pytest.fixture
def fake_ncu(tmp_path, monkeypatch):
    """An `ncu` on PATH that writes FAKE_NCU_LOG into its --log-file and records its arguments."""
    tool = tmp_path / "bin" / "ncu"
    tool.parent.mkdir()
    tool.write_text('#!/bin/sh\necho "$@" > "$FAKE_NCU_ARGS"\nwhile [ "$1" != --log-file ]; do shift; done\n'
                    'cat "$FAKE_NCU_LOG" > "$2"\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NCU_ARGS", str(tmp_path / "args"))
    monkeypatch.setenv("FAKE_NCU_LOG", str(tmp_path / "log"))
    return tmp_path


def test_the_ncu_pass_profiles_the_decode_kernel_at_both_shapes(fake_ncu):
    (fake_ncu / "log").write_text(NCU_CSV)
    result = gpu_first_contact.ncu_pass(str(fake_ncu), timeout_s=30)
    assert result["ok"] and result["135m"] == PARSED and result["8b"] == PARSED
    args = (fake_ncu / "args").read_text().split()
    assert args[:8] == ["--target-processes", "all", "--kernel-name", "regex:_decode_partial_kernel",
                        "--launch-skip", "2", "--launch-count", "1"]
    assert args[args.index("--shapes") + 1] == "8b" and args[args.index("--metrics") + 1].split(",") == list(
        gpu_first_contact.NCU_METRICS)


def test_counters_closed_to_the_user_are_a_skip_and_no_kernel_profiled_is_an_error(fake_ncu):
    (fake_ncu / "log").write_text("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access "
                                  "NVIDIA GPU Performance Counters on the target device 0.\n")
    result = gpu_first_contact.ncu_pass(str(fake_ncu), timeout_s=30)
    assert result["ok"] and result["135m"] == {
        "skipped": "the GPU performance counters are not open to this user (ERR_NVGPUCTRPERM)"}
    (fake_ncu / "log").write_text("==PROF== No kernels were profiled.\n")
    result = gpu_first_contact.ncu_pass(str(fake_ncu), timeout_s=30)
    assert not result["ok"] and result["8b"]["error"].startswith("rc=0, no kernel profiled: ==PROF== No kernels")


def test_the_report_joins_the_steps_and_puts_the_versions_next_to_each_figure(tmp_path):
    (tmp_path / "steps.tsv").write_text("environment 0 3\ngpu_check 1 377\ndefault_start 0 41\n")
    (tmp_path / "default_start.json").write_text(json.dumps({"decode": {"decode_tok_per_s": 5000.0}}))
    (tmp_path / "gpu_check_sh.json").write_text(json.dumps({"torch": "2.11.0+cu130", "passed": False}))
    report = gpu_first_contact.report(str(tmp_path), gpu=True, skipped=["ncu: none"])
    assert report["steps"] == {"environment": {"rc": 0, "seconds": 3, "ok": True},
                               "gpu_check": {"rc": 1, "seconds": 377, "ok": False},
                               "default_start": {"rc": 0, "seconds": 41, "ok": True}}
    assert (report["failed_steps"], report["passed"], report["skipped"]) == (["gpu_check"], False, ["ncu: none"])
    assert report["default_start"]["versions"] == report["versions"]
    assert report["versions"]["torch"] == torch.__version__
    assert report["gpu_check"]["torch"] == "2.11.0+cu130" and "environment" not in report
