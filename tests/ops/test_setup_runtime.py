"""The tritonserver runtime layout and server start-up failures (no model needed)."""

import os
import subprocess

import pytest

from omni_backend.setup import runtime
from omni_backend.launch.ports import free_ports
from omni_backend.launch.tritonserver import TritonServer, TritonServerError


def test_runtime_layout(tmp_path):
    target = tmp_path / "tritonserver"
    assert runtime.ensure_runtime(target, log=lambda _: None)
    assert not runtime.ensure_runtime(target, log=lambda _: None)  # idempotent
    binary = runtime.tritonserver_binary(target)
    stub = target / "backends" / "python" / "triton_python_backend_stub"
    assert os.access(binary, os.X_OK) and os.access(stub, os.X_OK)
    lib = target / "lib"
    for name in runtime.PERF_ANALYZER_LIBS:
        assert (lib / name).resolve().is_file()
    env = dict(os.environ, LD_LIBRARY_PATH=runtime.library_path(target))
    ldd = subprocess.run(["ldd", str(binary)], env=env, capture_output=True, text=True).stdout
    assert "not found" not in ldd


@pytest.mark.server
def test_start_failure_surfaces_the_model_error(tmp_path):
    model = tmp_path / "repo" / "broken"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 0\n'
                                        'input [{ name: "x" data_type: TYPE_FP32 dims: [1] }]\n'
                                        'output [{ name: "y" data_type: TYPE_FP32 dims: [1] }]\n')
    (model / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def initialize(self, args):\n        raise RuntimeError('kaboom 42')\n")
    http, grpc, metrics = free_ports(3)
    server = TritonServer(tmp_path / "repo", http, grpc, metrics, exit_timeout_s=1, log_file=tmp_path / "log")
    with pytest.raises(TritonServerError, match="kaboom 42"):
        server.start(ready_timeout_s=60)
    assert server.process is None
