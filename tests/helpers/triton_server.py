"""A tritonserver over a rendered model repository, for the server tests that render their own."""

from __future__ import annotations

from pathlib import Path

from omni_backend import repository
from omni_backend.launch.ports import free_ports
from omni_backend.launch.tritonserver import TritonServer


def start_tritonserver(root: Path) -> TritonServer:
    """Start tritonserver on free ports over `root / "model_repository"` (its log: `root / "tritonserver.log"`; Triton
    kernels compiled, not interpreted) and wait until it is ready (at most 300 s); the caller stops it."""
    http, grpc, metrics = free_ports(3)
    server = TritonServer(root / "model_repository", http_port=http, grpc_port=grpc, metrics_port=metrics,
                          exit_timeout_s=5, log_file=root / "tritonserver.log", env={"TRITON_INTERPRET": None})
    server.start(ready_timeout_s=300)
    return server


def serve_models(root: Path, models: list[str], **settings) -> TritonServer:
    """Render `models` of model_repository/ with `settings` (repository settings) into `root / "model_repository"`
    and start a tritonserver over them (`start_tritonserver`); the caller stops it."""
    repository.render_repository(root / "model_repository", models=models, **settings)
    return start_tritonserver(root)
