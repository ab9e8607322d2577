"""Fixtures for tests against a real tritonserver (client helpers: tests/chat_client.py).

`triton_server` (session scope) renders the model repository with test settings into a temporary folder and
starts one tritonserver on free ports for the whole session; `stages_server` serves only the preprocess and
postprocess stages, so they are tested on a real server apart from the LLM. Tests using them are marked
`server`.
"""

from __future__ import annotations

import os

import torch

# OpenAI-Triton picks its interpreter when a kernel is decorated, i.e. when `kernels` is first imported, which
# engine tests do before tests/kernels is collected: decide it here, for the whole test process.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from chat_client import free_ports  # noqa: E402

from omni_backend import repository  # noqa: E402
from omni_backend.triton_server import TritonServer  # noqa: E402

# Small KV cache: enough for the tests' concurrency, light on a 2-core CI machine.
# float32: greedy equality across batch compositions (a request alone vs among 8) holds in fp32; bf16 matmuls
# (the CPU default where AMX/AVX512-BF16 exist) round differently at different batch sizes.
# 96 MiB of fp32 KV holds 2184 tokens: one max_model_len (2048) request fits, as requests without max_tokens need.
TEST_SETTINGS = {"kv_cache_bytes": 96 * 1024 * 1024, "max_num_seqs": 16, "dtype": "float32"}


def _start_server(tmp_path_factory, models: list[str] | None) -> TritonServer:
    root = tmp_path_factory.mktemp("triton")
    model_repository = root / "model_repository"
    repository.render_repository(model_repository, models=models, **TEST_SETTINGS)
    http, grpc, metrics = free_ports(3)
    server = TritonServer(
        model_repository, http_port=http, grpc_port=grpc, metrics_port=metrics, exit_timeout_s=5,
        log_file=root / "tritonserver.log",
        env={"TRITON_INTERPRET": None},  # set by tests/kernels for this process; not for the server
    )
    return server.start(ready_timeout_s=300)


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory) -> TritonServer:
    """One tritonserver for the session: every model of model_repository/, rendered with TEST_SETTINGS."""
    server = _start_server(tmp_path_factory, None)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stages_server(tmp_path_factory) -> TritonServer:
    """A tritonserver with only the preprocess and postprocess stages (no LLM: starts in seconds)."""
    server = _start_server(tmp_path_factory, ["preprocess", "postprocess"])
    yield server
    server.stop()




@pytest.fixture(scope="session")
def front_door(triton_server):
    """The OpenAI front door every test shares (no API key, default limits), on the session's server."""
    from front_door import FrontDoorThread, front_door_config

    door = FrontDoorThread(front_door_config(triton_server)).start()
    yield door
    door.stop()
