"""docker/: what can be checked without Docker or a cluster (neither exists on this project's machines)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import yaml

from omni_backend import paths, repository

DOCKER = paths.PROJECT_ROOT / "docker"


def test_entrypoint_renders_the_selected_models_and_runs_tritonserver_on_them(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "tritonserver").write_text('#!/bin/sh\necho "tritonserver $*"\n')
    (fake_bin / "tritonserver").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "OMNI_CACHE_DIR": str(tmp_path / "cache"), "OMNI_MODELS": "preprocess,llm,postprocess,omni_chat",
           "OMNI_GRPC_PORT": "9101"}
    run = subprocess.run(["bash", str(DOCKER / "entrypoint.sh"), "--log-verbose=1"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    repo = tmp_path / "cache" / "model_repository"
    assert sorted(p.name for p in repo.iterdir()) == ["llm", "omni_chat", "postprocess", "preprocess"]
    assert f"--model-repository={repo} --http-port=8000 --grpc-port=9101 --metrics-port=8002" in run.stdout
    assert run.stdout.rstrip().endswith("--log-verbose=1")


def ensemble_steps(model: str) -> set[str]:
    text = (paths.MODEL_REPOSITORY_TEMPLATES / model / "config.pbtxt").read_text()
    return set(re.findall(r'model_name:\s*"(\w+)"', text)) if 'platform: "ensemble"' in text else set()


def test_k8s_deployments_serve_existing_models_with_every_ensemble_step_alongside():
    docs = list(yaml.safe_load_all((DOCKER / "k8s" / "omni-stages.yaml").read_text()))
    known = set(repository.model_names())
    served = []
    for doc in docs:
        if doc["kind"] != "Deployment":
            continue
        container = doc["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        if "OMNI_MODELS" not in env:
            continue
        models = set(env["OMNI_MODELS"].split(","))
        assert models <= known, models - known
        for model in models:
            assert ensemble_steps(model) <= models, f"{model}'s steps must be served by the same deployment"
        served.append(models)
    assert {"llm", "omni_chat"} <= served[0] and any("tts" in m for m in served)


def test_dockerfile_copies_what_the_repository_has():
    text = (DOCKER / "Dockerfile").read_text()
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["nvcr.io/nvidia/tritonserver:24.10-py3"]
    for source in re.findall(r"^COPY (\S+(?: \S+)*) \S+$", text, re.M):
        for path in source.split():
            assert (paths.PROJECT_ROOT / path).exists(), path
