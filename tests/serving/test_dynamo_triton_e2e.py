"""End to end: one tritonserver whose llm stage also serves Dynamo (the `dynamo_endpoint` setting,
stages/llm/dynamo_endpoint.py), behind etcd + NATS + Dynamo's frontend on localhost: the frontend answers a chat
through the stage's engine, and the same server answers a gRPC request to its llm model, from the same engine
(the Dynamo request after it reuses the prefix the Triton request left in the engine's prefix cache).

Opt-in, as tests/serving/test_dynamo_e2e.py: it runs only with OMNI_DYNAMO_TESTS=1 and skips without the Dynamo
packages in the running interpreter's venv (the server's Python stubs use that venv: launch/tritonserver.py):

    scripts/setup.sh --dynamo
    OMNI_DYNAMO_TESTS=1 flock /tmp/omni-server-tests.lock .venv/bin/python -m pytest \
        tests/serving/test_dynamo_triton_e2e.py -q
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request

import openai
import pytest

from omni_backend import paths, repository

if os.environ.get("OMNI_DYNAMO_TESTS") != "1":
    pytest.skip("opt-in (minutes): set OMNI_DYNAMO_TESTS=1", allow_module_level=True)
pytest.importorskip("dynamo.llm", reason="the Dynamo worker's packages are not installed: scripts/setup.sh --dynamo")

from helpers.llm_stream import LLMStream, llm_inputs

from omni_backend.launch.dynamo.control_plane import etcd_command, nats_command, wait_etcd_and_nats
from omni_backend.launch.dynamo.local import find_binary, frontend_python
from omni_backend.launch.ports import free_ports
from omni_backend.launch.tritonserver import TritonServer

pytestmark = [pytest.mark.dynamo, pytest.mark.server]

MODEL = str(paths.models_dir() / "SmolLM2-135M-Instruct")
QUESTION = "What is the capital of France?"
SETTINGS = {"kv_cache_bytes": 96 * 1024 * 1024, "max_num_seqs": 8, "dtype": "float32"}  # as the other e2e's


def _wait_listed(url: str, model: str, timeout_s: float, processes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in processes:
            assert process.poll() is None, f"{process.args[0]} exited with code {process.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if model in response.read().decode():
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"{model} not listed at {url} within {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """etcd, NATS, Dynamo's frontend (KV routing) and one tritonserver (preprocess + llm, the llm stage on Dynamo
    endpoint omni.llm.generate): (server, frontend's OpenAI base URL)."""
    try:
        etcd, nats_server = find_binary("etcd"), find_binary("nats-server")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    if not frontend_python().exists():
        pytest.skip("Dynamo's frontend venv is missing: scripts/setup.sh --dynamo")
    root = tmp_path_factory.mktemp("dynamo-triton")
    etcd_client, etcd_peer, nats_port, http = free_ports(4)
    env = dict(os.environ, ETCD_ENDPOINTS=f"http://127.0.0.1:{etcd_client}", NATS_SERVER=f"nats://127.0.0.1:{nats_port}")
    processes: list[subprocess.Popen] = []
    server = None

    def spawn(name: str, command: list[str]) -> subprocess.Popen:
        with open(root / f"{name}.log", "ab") as log:
            processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
        return processes[-1]

    try:
        spawn("etcd", etcd_command(etcd, root / "etcd", etcd_client, etcd_peer))
        spawn("nats", nats_command(nats_server, root / "nats", nats_port))
        wait_etcd_and_nats(etcd_client, nats_port, 60, lambda: None, None)
        spawn("frontend", [str(frontend_python()), "-m", "dynamo.frontend", "--router-mode", "kv", "--http-host",
                           "127.0.0.1", "--http-port", str(http)])
        model_repository = root / "model_repository"
        repository.render_repository(model_repository, models=["preprocess", "llm"], **SETTINGS,
                                     llm_model_path=MODEL, dynamo_endpoint="omni.llm.generate",
                                     kv_events=f"ipc://{root}/kv-events")
        ports = free_ports(3)
        server = TritonServer(model_repository, *ports, exit_timeout_s=5, log_file=root / "tritonserver.log",
                              env={"TRITON_INTERPRET": None, "ETCD_ENDPOINTS": env["ETCD_ENDPOINTS"],
                                   "NATS_SERVER": env["NATS_SERVER"]}).start(ready_timeout_s=300)
        _wait_listed(f"http://127.0.0.1:{http}/v1/models", MODEL, 120, processes)
        yield server, f"http://127.0.0.1:{http}/v1"
    finally:
        if server is not None:
            server.stop()
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_dynamo_and_triton_requests_share_the_llm_stages_engine(deployment):
    server, base_url = deployment
    stream = LLMStream(server.grpc_url)
    stream.send(llm_inputs(server.grpc_url, QUESTION, 7))
    triton = stream.collect()
    assert (triton["error"], triton["text"], triton["tokens"]) == (None, "The capital of France is Paris.", 7)

    client = openai.OpenAI(base_url=base_url, api_key="unused")
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=32, temperature=0)
    assert answer.choices[0].message.content == "The capital of France is Paris."
    assert answer.choices[0].finish_reason == "stop" and answer.usage.prompt_tokens == 37
    # the Triton request's prompt blocks are in this engine's prefix cache: Dynamo's request found them there
    assert answer.usage.prompt_tokens_details.cached_tokens > 0

    again = LLMStream(server.grpc_url)  # and Triton still answers beside Dynamo
    again.send(llm_inputs(server.grpc_url, QUESTION, 7))
    assert again.collect()["text"] == "The capital of France is Paris."
