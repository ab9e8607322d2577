"""Fixtures for the OpenAI front door tests: the session's tritonserver (tests/conftest.py) plus front doors
served by uvicorn in background threads of this process, each on a free port."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
import uvicorn
from chat_client import free_ports

from omni_backend.serving import ServingConfig, create_app

MODEL = "omni_chat"


class FrontDoorThread:
    """One front door app served by uvicorn on a free port, in a daemon thread."""

    def __init__(self, config: ServingConfig):
        self.config = config
        self.server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=config.port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name=f"front-door-{config.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def start(self) -> "FrontDoorThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"front door on port {self.config.port} did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def front_door_config(triton_server, **overrides) -> ServingConfig:
    (port,) = free_ports(1)
    values = dict(triton_grpc=triton_server.grpc_url, triton_http=triton_server.http_url,
                  triton_metrics_url=triton_server.metrics_url, port=port)
    values.update(overrides)
    return ServingConfig(**values)


@pytest.fixture(scope="session")
def front_door(triton_server):
    """The front door every test shares (no API key, default limits)."""
    door = FrontDoorThread(front_door_config(triton_server)).start()
    yield door
    door.stop()


@pytest.fixture
def make_front_door(triton_server):
    """Start extra front doors with other settings (API key, limits); stopped after the test."""
    started = []

    def make(**overrides) -> FrontDoorThread:
        door = FrontDoorThread(front_door_config(triton_server, **overrides)).start()
        started.append(door)
        return door

    yield make
    for door in started:
        door.stop()


@pytest.fixture(scope="session")
def openai_client(front_door):
    import openai

    return openai.OpenAI(base_url=front_door.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def async_openai_client(front_door):
    import openai

    return openai.AsyncOpenAI(base_url=front_door.url + "/v1", api_key="unused", max_retries=0, timeout=120)
