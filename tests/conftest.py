"""Fixtures for tests against a real tritonserver (client helpers: tests/helpers/chat_client.py).

`triton_server` (session scope) renders the model repository with test settings into a temporary folder and
starts one tritonserver on free ports for the whole session; `stages_server` serves only the preprocess and
postprocess stages, so they are tested on a real server apart from the LLM. Tests using them are marked
`server`. `front_door` (session) is the OpenAI front door on that server (tests/helpers/front_door.py);
`make_front_door` starts extra ones with other settings; `openai_client`/`async_openai_client` talk to it.
"""

from __future__ import annotations

import os

import torch

# OpenAI-Triton picks its interpreter when a kernel is decorated, i.e. when `kernels` is first imported, which
# engine tests do before tests/kernels is collected: decide it here, for the whole test process.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from omni_backend import repository  # noqa: E402
from omni_backend.launch.ports import free_ports  # noqa: E402
from omni_backend.launch.tritonserver import TritonServer  # noqa: E402

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
    from helpers.front_door import FrontDoorThread, front_door_config

    door = FrontDoorThread(front_door_config(triton_server)).start()
    yield door
    door.stop()


@pytest.fixture
def make_front_door(triton_server):
    """Start extra front doors with other settings (API key, limits) on the session's server; stopped after
    the test."""
    from helpers.front_door import FrontDoorThread, front_door_config

    started = []

    def make(**overrides):
        door = FrontDoorThread(front_door_config(triton_server, **overrides)).start()
        started.append(door)
        return door

    yield make
    for door in started:
        door.stop()


@pytest.fixture(scope="session")
def openai_client(front_door):
    """A synchronous openai client on the session front door (no retries, 120 s timeout)."""
    import openai

    return openai.OpenAI(base_url=front_door.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def async_openai_client(front_door):
    """An asyncio openai client on the session front door (no retries, 120 s timeout)."""
    import openai

    return openai.AsyncOpenAI(base_url=front_door.url + "/v1", api_key="unused", max_retries=0, timeout=120)


NORMAL_REQUEST = {"model": "omni_chat", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                  "max_tokens": 16, "temperature": 0}
NORMAL_ANSWER = "The capital of France is Paris."
"""What SmolLM2-135M-Instruct answers NORMAL_REQUEST, greedy in float32 (the test server's dtype)."""


@pytest.fixture
def followed_by_a_normal_request(front_door):
    """After the test: a normal greedy chat request through the session front door gets 200 and exactly the
    model's answer (a test that leaves the server broken fails even if its own checks passed)."""
    yield
    from helpers.frontdoor_http import post

    status, _, body = post(front_door.url + "/v1/chat/completions", NORMAL_REQUEST, timeout=120)
    assert status == 200, f"the normal request after this test failed: {status} {body}"
    assert body["choices"][0]["message"]["content"] == NORMAL_ANSWER, body
    assert body["choices"][0]["finish_reason"] == "stop", body
