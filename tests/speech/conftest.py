"""Fixtures for speech tests: the session's tritonserver (tests/conftest.py) plus an OpenAI front door served by
uvicorn in a background thread of this process."""

from __future__ import annotations

import threading
import time

import pytest
import uvicorn
from chat_client import free_ports

from omni_backend.serving import ServingConfig, create_app

# tests/serving does `from conftest import MODEL`, which finds whichever conftest module was imported last:
# every conftest that can be that one defines it.
MODEL = "omni_chat"


class FrontDoorThread:
    """A front door app on a free port, in a daemon thread."""

    def __init__(self, triton_server):
        (port,) = free_ports(1)
        config = ServingConfig(triton_grpc=triton_server.grpc_url, triton_http=triton_server.http_url,
                               triton_metrics_url=triton_server.metrics_url, port=port)
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name=f"front-door-{port}", daemon=True)

    def start(self) -> "FrontDoorThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("front door did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def speech_door(triton_server):
    door = FrontDoorThread(triton_server).start()
    yield door
    door.stop()
