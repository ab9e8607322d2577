"""The memory settings (omni_backend/ops/memory_env.py) reach every way the product starts: the server's environment,
scripts/test.sh's shell exports and the Docker image's ENV (a copy by hand that must not drift)."""

from __future__ import annotations

import re
import subprocess
import sys

from omni_backend import paths
from omni_backend.ops.memory_env import memory_environment
from omni_backend.launch.tritonserver import TritonServer


def test_docker_image_sets_the_same_values():
    dockerfile = (paths.PROJECT_ROOT / "docker" / "Dockerfile").read_text()
    env_block = re.search(r"^ENV GLIBC_TUNABLES=.*?(?<!\\)\n", dockerfile, re.MULTILINE | re.DOTALL).group(0)
    found = dict(re.findall(r"([A-Z_]+)=(\S+)", env_block))
    assert found == memory_environment()


def test_shell_exports_keep_a_value_already_set():
    printed = subprocess.run([sys.executable, "-m", "omni_backend.ops.memory_env"], capture_output=True, text=True,
                             check=True).stdout
    script = printed + 'echo "$ONEDNN_PRIMITIVE_CACHE_CAPACITY $LRU_CACHE_CAPACITY $GLIBC_TUNABLES"'
    shell = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                           env={"PATH": "/usr/bin:/bin", "LRU_CACHE_CAPACITY": "7"})
    expected = memory_environment()
    assert shell.stdout.split() == [expected["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], "7", expected["GLIBC_TUNABLES"]]


def test_server_environment_sets_them_unless_the_caller_did(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "5")
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    env = TritonServer(tmp_path).environment()
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "5"
    assert env["LRU_CACHE_CAPACITY"] == memory_environment()["LRU_CACHE_CAPACITY"]
    assert env["GLIBC_TUNABLES"] == memory_environment()["GLIBC_TUNABLES"]
