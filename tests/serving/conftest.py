"""Fixtures for the OpenAI front door tests: the session's tritonserver (tests/conftest.py) plus front doors
served by uvicorn in background threads of this process, each on a free port."""

from __future__ import annotations

import pytest
from front_door import FrontDoorThread, front_door_config


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
