"""docker/: what can be checked without Docker or a cluster (neither exists on this project's machines)."""

from __future__ import annotations

import ast
import itertools
import os
import re
import subprocess
import sys

from helpers import docker_image
import yaml

from omni_backend import paths, repository
from omni_backend.setup import smollm2

DOCKER = paths.PROJECT_ROOT / "docker"


def test_entrypoint_renders_the_selected_models_and_runs_tritonserver_on_them(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "tritonserver").write_text('#!/bin/sh\necho "tritonserver $*"\n')
    (fake_bin / "tritonserver").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "OMNI_CACHE_DIR": str(tmp_path / "cache"), "OMNI_MODELS": "preprocess,llm,postprocess,omni_chat",
           "OMNI_GRPC_PORT": "9101", "OMNI_ADMIN_KEY": "k3y"}
    run = subprocess.run(["bash", str(DOCKER / "entrypoint.sh"), "--log-verbose=1"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    repo = tmp_path / "cache" / "model_repository"
    assert sorted(p.name for p in repo.iterdir()) == ["llm", "omni_chat", "postprocess", "preprocess"]
    assert f"--model-repository={repo} --http-port=8000 --grpc-port=9101 --metrics-port=8002" in run.stdout
    restricted = "model-repository,logging,trace,shared-memory:omni-admin-key=k3y"
    assert f"--http-restricted-api={restricted} --grpc-restricted-protocol={restricted}" in run.stdout
    assert run.stdout.rstrip().endswith("--log-verbose=1")


def pipeline_steps(model: str) -> set[str]:
    """The models `model` calls: an ensemble's steps, a streaming entry point's `*_model` parameters."""
    text = (paths.MODEL_REPOSITORY_TEMPLATES / model / "config.pbtxt").read_text()
    return (set(re.findall(r'model_name:\s*"(\w+)"', text))
            | set(re.findall(r'key: "\w+_model" value: \{ string_value: "(\w+)" \}', text)))


def test_k8s_deployments_serve_existing_models_with_every_pipeline_step_alongside():
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
            assert pipeline_steps(model) <= models, f"{model}'s steps must be served by the same deployment"
        served.append(models)
    assert {"llm", "omni_chat"} <= served[0] and any("tts" in m for m in served)
    assert pipeline_steps("omni_chat") == {"preprocess", "llm", "postprocess"}


def test_dockerfile_copies_what_the_repository_has():
    text = docker_image.dockerfile_text()
    assert docker_image.base_release() in docker_image.NGC_TRITON_RELEASES
    for source in re.findall(r"^COPY (\S+(?: \S+)*) \S+$", text, re.M):
        for path in source.split():
            assert (paths.PROJECT_ROOT / path).exists(), path


def test_dockerfile_base_has_the_security_fixes_and_a_cuda_that_runs_the_torch_it_installs():
    release = docker_image.base_release()
    assert tuple(int(part) for part in release.split(".")) >= docker_image.OLDEST_SECURE_RELEASE
    image_cuda = docker_image.NGC_TRITON_RELEASES[release].cuda
    torch_cuda = docker_image.torch_flavor().cuda
    # The image needs a driver for its CUDA; that driver runs torch's CUDA when both are one major version and torch's
    # is not newer (drivers are backward compatible: NVIDIA "CUDA Compatibility"). A CPU torch would waste the image.
    assert torch_cuda is not None and torch_cuda[0] == image_cuda[0] and torch_cuda <= image_cuda, (torch_cuda, image_cuda)


def test_dockerfile_installs_torch_from_torch_flavor_into_a_venv_of_the_images_python():
    text = docker_image.dockerfile_text()
    packages = re.search(r"apt-get install -y --no-install-recommends ([^\\&\n]+)", text).group(1).split()
    # python3-dev: OpenAI Triton compiles its launcher against Python.h; g++: that and the CPU decode kernel
    assert {"python3-venv", "python3-dev", "g++"} <= set(packages)
    assert re.search(r"^RUN python3 -m venv ", text, re.M)  # the image's python3, which its backend stub is built for
    assert 'torch_flavor.py requirements "$OMNI_TORCH_CUDA"' in text
    assert "-r /tmp/torch-requirements.txt -r requirements.txt" in text
    assert 'torch_flavor.py check "$OMNI_TORCH_CUDA"' in text
    assert re.search(r"^RUN python -m omni_backend.ops.triton_build$", text, re.M)  # gcc + Python.h, checked
    # no torch or triton version of its own, no index of its own, and the image's own Python backend stub
    assert not re.search(r"torch==|triton==|TORCH_VERSION|download\.pytorch\.org", text)
    assert "python_backend_stub" not in text.replace("/opt/tritonserver/backends/python/triton_python_backend_stub", "")
    assert "pytriton" not in text


def test_dockerfile_runs_the_kernel_tests_when_the_build_sees_a_gpu():
    text = docker_image.dockerfile_text()
    assert "COPY tests/kernels ./tests/kernels" in text
    step = re.search(r"^RUN if nvidia-smi -L; then(.*?)fi$", text, re.M | re.S).group(1)
    assert "python -m pytest tests/kernels" in step and "kernel tests skipped at build time" in step


def flag_values(args: list[str]) -> dict[str, str]:
    """`--flag value` pairs of a container's argument list."""
    return {flag: value for flag, value in itertools.pairwise(args) if flag.startswith("--")}


def test_inference_pool_selects_front_doors_that_read_their_own_pods_tritonserver():
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((DOCKER / "k8s" / "inference-gateway.yaml").read_text())}
    pool, route, pods = docs["InferencePool"], docs["HTTPRoute"], docs["Deployment"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= pods["spec"]["template"]["metadata"]["labels"].items()
    containers = {c["name"]: c for c in pods["spec"]["template"]["spec"]["containers"]}
    front_door = flag_values(containers["openai"]["args"])
    # the picker sends requests to, and scrapes /metrics from, the pool's port: the front door's, whose /metrics
    # carries the vllm:* gauges of the tritonserver it names (the entrypoint's default ports, in the same pod)
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [int(front_door["--port"])]
    assert front_door["--triton-grpc"] == "localhost:8001" and front_door["--triton-http"] == "localhost:8000"
    assert front_door["--triton-metrics"] == "http://localhost:8002/metrics"
    triton_env = {e["name"]: e["value"] for e in containers["triton"]["env"]}
    assert not {"OMNI_GRPC_PORT", "OMNI_HTTP_PORT", "OMNI_METRICS_PORT"} & triton_env.keys()
    assert triton_env["OMNI_DEVICE"] == "cuda:0"  # one engine per pod: one series of each gauge per endpoint
    assert pipeline_steps("omni_chat") | {"omni_chat"} == set(triton_env["OMNI_MODELS"].split(","))
    backends = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "omni-pool"}]


def launcher_flags(module: str) -> dict[str, tuple | None]:
    """The `--flags` a launcher's argparse parser declares, with their `choices` (None: any value), read from its
    source: the parser is built inside the launcher's `main`, which goes on to serve."""
    tree = ast.parse((paths.PROJECT_ROOT / module).read_text())
    flags = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            name = node.args[0].value
            if name.startswith("--"):
                choices = [ast.literal_eval(k.value) for k in node.keywords if k.arg == "choices"]
                flags[name] = tuple(choices[0]) if choices else None
    return flags


def test_dynamo_graph_runs_our_worker_launcher_behind_a_kv_routing_frontend():
    graph = yaml.safe_load((DOCKER / "dynamo" / "omni-dynamo.yaml").read_text())
    assert (graph["apiVersion"], graph["kind"]) == ("nvidia.com/v1alpha1", "DynamoGraphDeployment")
    services = graph["spec"]["services"]
    by_type = {service["componentType"]: service for service in services.values()}
    assert sorted(by_type) == ["frontend", "worker"]
    frontend = by_type["frontend"]["extraPodSpec"]["mainContainer"]
    assert frontend["command"] == ["python3", "-m", "dynamo.frontend"]
    assert flag_values(frontend["args"])["--router-mode"] == "kv"
    worker = by_type["worker"]
    container = worker["extraPodSpec"]["mainContainer"]
    assert container["command"] == ["python", "-m", "omni_backend.launch.dynamo"]
    known = launcher_flags("omni_backend/launch/dynamo/__main__.py")
    args = flag_values(container["args"])
    assert "--model" in args and args.keys() <= known.keys(), args.keys() - known.keys()
    for flag, value in args.items():
        assert known[flag] is None or value in known[flag], (flag, value)
    # the served folder is where the image's build converts SmolLM2 (OMNI_CACHE_DIR/models/<name>)
    cache = re.search(r"OMNI_CACHE_DIR=(\S+)", docker_image.dockerfile_text()).group(1)
    assert args["--model"] == f"{cache}/models/{smollm2.MODEL_NAME}"
    # the image the Dockerfile builds with Dynamo's worker runtime, which the launcher imports
    assert container["image"] == "omni-serving:dynamo"
    assert "OMNI_DYNAMO" in docker_image.dockerfile_text()
    assert "ai-dynamo-runtime==" in (paths.PROJECT_ROOT / "requirements-dynamo.txt").read_text()
    # probes on the port Dynamo's system server (health, liveness) listens on
    env = {e["name"]: e["value"] for e in worker["envs"]}
    assert env["DYN_SYSTEM_ENABLED"] == "true"
    probes = [worker["livenessProbe"], worker["readinessProbe"], container["startupProbe"]]
    assert {probe["httpGet"]["port"] for probe in probes} == {int(env["DYN_SYSTEM_PORT"])}
    assert worker["resources"]["limits"]["gpu"] == "1" and worker["replicas"] >= 2
