"""The OpenAI front door for tests: served by uvicorn in a background thread of the test process, on a free
port, in front of the session's tritonserver (tests/conftest.py)."""

from __future__ import annotations

import threading
import time

import uvicorn

from omni_backend.launch.ports import free_ports
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
    """Settings for a front door on a free port talking to `triton_server`; keyword overrides win."""
    (port,) = free_ports(1)
    values = dict(triton_grpc=triton_server.grpc_url, triton_http=triton_server.http_url,
                  triton_metrics_url=triton_server.metrics_url, port=port, admin_key=triton_server.admin_key)
    values.update(overrides)
    return ServingConfig(**values)
