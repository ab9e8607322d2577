"""Fixtures for the reliability tests (`-m reliability`): failure modes against the real stack.

Every test under tests/reliability gets the `reliability` and `server` markers. Tests that only send requests
use the session's server and front door (tests/conftest.py); tests that break, overload or stop a server get
their own from `make_chat_server`: the text-chat models only (preprocess, llm, postprocess, omni_chat), so it
starts in seconds and dies alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_backend import repository
from omni_backend.launch.ports import free_ports
from omni_backend.launch.tritonserver import TritonServer

CHAT_MODELS = ["preprocess", "llm", "postprocess", "omni_chat"]
_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if _HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.reliability)
            item.add_marker(pytest.mark.server)


def _test_settings(config) -> dict:
    """TEST_SETTINGS of tests/conftest.py. Not `from conftest import ...`: every conftest.py outside a package is
    module `conftest`, and pytest drops the previous one from sys.modules before importing the next, so that
    import would find this file."""
    return config.pluginmanager.get_plugin(str(_HERE.parent / "conftest.py")).TEST_SETTINGS


@pytest.fixture
def make_chat_server(tmp_path_factory, request):
    """Start a dedicated text-chat tritonserver; keyword arguments override TEST_SETTINGS (e.g.
    `max_num_seqs=2`), `exit_timeout_s` sets `--exit-timeout-secs`. Servers still running after the test are
    stopped."""
    started: list[TritonServer] = []

    def make(exit_timeout_s: int = 5, models: list[str] | None = None, **overrides) -> TritonServer:
        root = tmp_path_factory.mktemp("triton-reliability")
        model_repository = root / "model_repository"
        repository.render_repository(model_repository, models=models or CHAT_MODELS,
                                     **{**_test_settings(request.config), **overrides})
        http, grpc, metrics = free_ports(3)
        server = TritonServer(model_repository, http_port=http, grpc_port=grpc, metrics_port=metrics,
                              exit_timeout_s=exit_timeout_s, log_file=root / "tritonserver.log",
                              env={"TRITON_INTERPRET": None})
        started.append(server)
        return server.start(ready_timeout_s=300)

    yield make
    for server in started:
        server.stop()
