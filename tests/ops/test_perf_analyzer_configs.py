"""perf_analyzer_configs/: every model has input data matching its inputs, and run.sh's command works."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from omni_backend import paths, repository

CONFIGS = paths.PROJECT_ROOT / "perf_analyzer_configs"
_INPUT = re.compile(r'\{\s*name:\s*"(\w+)"[^}]*?(optional:\s*true)?\s*\}')


def model_inputs(model: str) -> dict[str, bool]:
    """Input name -> required, from the model's config.pbtxt `input [...]` block."""
    text = (paths.MODEL_REPOSITORY_TEMPLATES / model / "config.pbtxt").read_text()
    text = re.sub(r"#.*", "", text)
    block = re.search(r"\binput\s*\[(.*?)\]\s*output", text, re.S).group(1)
    return {name: not optional for name, optional in _INPUT.findall(block)}


def input_data(model: str) -> list[dict]:
    return json.loads((CONFIGS / ("omni_chat" if model == "preprocess" else model)).with_suffix(".json")
                      .read_text())["data"]


@pytest.mark.parametrize("model", repository.model_names())
def test_every_model_has_input_data_for_its_inputs(model):
    inputs = model_inputs(model)
    assert model in (CONFIGS / "run.sh").read_text(), f"run.sh has no command for {model}"
    for request in input_data(model):
        assert set(request) <= set(inputs), f"{model}: unknown inputs {set(request) - set(inputs)}"
        assert {n for n, required in inputs.items() if required} <= set(request), f"{model}: required input missing"


@pytest.mark.server
@pytest.mark.parametrize("model", ["preprocess", "llm", "postprocess"])
def test_run_sh_measures_each_stage(governed_server, model):
    run = subprocess.run(["bash", str(CONFIGS / "run.sh"), model, "--concurrency-range", "1", "--request-count", "2"],
                         env={**os.environ, "OMNI_GRPC_URL": governed_server.grpc_url},
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert float(re.search(r"Throughput: ([0-9.]+) infer/sec", run.stdout).group(1)) > 0
