"""perf_analyzer (gRPC streaming) against omni_chat with the documented input data."""

import re
import subprocess

import pytest

from omni_backend import paths

pytestmark = pytest.mark.server


def test_perf_analyzer_reports_throughput(triton_server, tmp_path):
    command = [
        "bash", str(paths.PROJECT_ROOT / "scripts" / "perf_analyzer.sh"),
        "-m", "omni_chat", "-i", "grpc", "--async", "--streaming", "-u", triton_server.grpc_url,
        "--input-data", str(paths.PROJECT_ROOT / "perf_analyzer_configs" / "omni_chat.json"),
        "--concurrency-range", "2", "--request-count", "8",
        "--profile-export-file", str(tmp_path / "profile.json"),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    match = re.search(r"Throughput: ([0-9.]+) infer/sec", run.stdout)
    assert match and float(match.group(1)) > 0, run.stdout[-3000:]
    assert (tmp_path / "profile.json").stat().st_size > 0
