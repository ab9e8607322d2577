"""A tritonserver with the multimodal chat pipeline (fp32, so batched and one-by-one answers compare exactly)
and a front door on it, for this folder's server tests."""

from __future__ import annotations

import threading
import time

import pytest
from helpers.triton_server import serve_models

from omni_backend.launch.ports import free_ports

MODELS = ["preprocess", "llm", "postprocess", "omni_chat", "vision_encoder", "audio_encoder", "media_embed",
          "omni_chat_mm"]


@pytest.fixture(scope="module")
def mm_server(tmp_path_factory):
    server = serve_models(tmp_path_factory.mktemp("triton-mm"), MODELS, dtype="float32",
                          kv_cache_bytes=96 * 1024 * 1024, max_num_seqs=16)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mm_front_door(mm_server):
    import uvicorn

    from omni_backend.serving import ServingConfig, create_app

    (port,) = free_ports(1)
    config = ServingConfig(triton_grpc=mm_server.grpc_url, triton_http=mm_server.http_url,
                           triton_metrics_url=mm_server.metrics_url, port=port, host="127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "front door did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
