"""What OpenAI Triton needs to build its kernel launchers on a GPU (a C compiler and Python.h,
omni_backend/ops/triton_build.py): found, missing or broken, the install hint by distribution, setup's check as a
command, and the attention selector refusing `triton` (explicit) or falling back (auto) when they are missing."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from omni_backend import paths
from omni_backend.engine.attention import selector
from omni_backend.ops import triton_build

MISSING = ("no C compiler on PATH (gcc or clang)",)


def test_this_machine_can_build_the_launcher():  # gcc and the python3.11-dev headers are part of its setup
    assert triton_build.launcher_problems() == []
    assert os.path.exists(os.path.join(triton_build.python_include_dir(), "Python.h"))


def test_no_compiler_and_no_headers_are_both_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert triton_build.c_compiler() is None
    problems = triton_build.launcher_problems(include_dir=str(tmp_path))
    assert problems == [f"no C compiler on PATH ($CC={tmp_path / 'no-such-cc'})",
                        f"no {tmp_path / 'Python.h'} (the Python {sys.version_info.major}.{sys.version_info.minor} "
                        "headers)"]


def test_headers_that_do_not_compile_are_a_problem_with_the_compilers_words(tmp_path):
    (tmp_path / "Python.h").write_text("#error these are not the Python headers\n")
    problems = triton_build.launcher_problems(compiler="gcc", include_dir=str(tmp_path))
    assert len(problems) == 1
    assert problems[0].startswith(f"gcc cannot compile against {tmp_path / 'Python.h'}: ")
    assert "these are not the Python headers" in problems[0]


def test_cc_is_taken_as_triton_takes_it(monkeypatch):
    gcc = shutil.which("gcc")
    monkeypatch.setenv("CC", "gcc")
    assert triton_build.c_compiler() == gcc
    monkeypatch.setenv("CC", "")  # Triton runs an empty $CC as the compiler: it cannot build
    assert triton_build.c_compiler() is None
    monkeypatch.delenv("CC")
    assert triton_build.c_compiler() == gcc


@pytest.mark.parametrize("os_release, command", [
    ('ID=debian\nVERSION_ID="12"\n', "`apt-get install -y gcc python{v}-dev`"),
    ('ID=ubuntu\nID_LIKE=debian\n', "`apt-get install -y gcc python{v}-dev`"),
    ('ID="rocky"\nID_LIKE="rhel centos fedora"\n', "`dnf install -y gcc python{v}-devel`"),
])
def test_install_hint_by_distribution(os_release, command):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert triton_build.install_hint(os_release) == f"Install them with {command.format(v=version)} (as root)"


def test_install_hint_elsewhere_says_what_to_install_and_where_python_h_goes():
    hint = triton_build.install_hint("ID=alpine\n")
    assert hint.startswith("Install a C compiler (gcc or clang) and the development headers of Python ")
    assert triton_build.python_include_dir() in hint
    assert triton_build.problem_message(MISSING, "ID=alpine\n") == (
        f"Triton cannot build its GPU kernel launchers here: no C compiler on PATH (gcc or clang). {hint}.")


def test_setup_check_exits_1_naming_the_problem_and_the_fix():
    env = {**os.environ, "PYTHONPATH": str(paths.PROJECT_ROOT), "CC": "no-such-cc"}
    run = subprocess.run([sys.executable, "-m", "omni_backend.ops.triton_build"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 1
    assert run.stderr.startswith("[triton_build] error: Triton cannot build its GPU kernel launchers here: no C "
                                 f"compiler on PATH ($CC=no-such-cc). {triton_build.install_hint()}. Then rerun "
                                 "scripts/setup.sh.")
    ok = subprocess.run([sys.executable, "-m", "omni_backend.ops.triton_build"], env={**env, "CC": "gcc"},
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith(f"[triton_build] C compiler {shutil.which('gcc')} and ")


def test_setup_runs_the_check_for_every_cuda_flavour_and_stops_on_its_failure():
    text = (paths.PROJECT_ROOT / "scripts" / "setup.sh").read_text()
    assert text.startswith("#!/usr/bin/env bash") and "\nset -euo pipefail\n" in text  # a failed check stops setup
    assert re.search(r'^if \[\[ "\$flavor" != cpu \]\]; then\n  PYTHONPATH="\$ROOT" "\$VENV/bin/python" -m '
                     r"omni_backend\.ops\.triton_build\nfi$", text, re.M)


def _on_a_gpu_without_launcher_tools(monkeypatch):
    monkeypatch.setattr(selector, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(selector, "launcher_problems_here", lambda: MISSING)


def test_explicit_triton_on_a_gpu_without_launcher_tools_is_refused_before_any_kernel(monkeypatch, tmp_path):
    _on_a_gpu_without_launcher_tools(monkeypatch)
    monkeypatch.setattr(selector, "self_test", lambda *args: pytest.fail("a kernel ran"))
    with pytest.raises(RuntimeError) as refused:
        selector.select_attention("triton", torch.device("cuda", 0), 9, 3, 64, torch.bfloat16, 16, str(tmp_path))
    assert str(refused.value) == ("attention_backend=triton cannot run on cuda:0: "
                                  + triton_build.problem_message(MISSING))


def test_auto_on_a_gpu_without_launcher_tools_serves_torch_and_says_what_was_disabled(monkeypatch, tmp_path,
                                                                                       caplog):
    _on_a_gpu_without_launcher_tools(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=selector.logger.name):
        choice = selector.select_attention("auto", torch.device("cuda", 0), 9, 3, 64, torch.bfloat16, 16,
                                           str(tmp_path))
    assert choice.backend.name == "torch"
    assert choice.reason == "auto: Triton cannot build its kernel launchers here"
    # the fallback reason is omni_runtime_info's fallback_reason label (stages/llm/build.py)
    assert choice.fallback_reason == "triton kernel launchers: " + triton_build.problem_message(MISSING)
    assert "attention backend triton disabled, using torch (eager, no CUDA graphs): Triton cannot build" in caplog.text


def test_the_interpreter_on_cpu_builds_no_launcher_and_is_not_checked(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(selector, "launcher_problems_here", lambda: pytest.fail("checked on CPU"))
    choice = selector.select_attention("triton", torch.device("cpu"), 4, 2, 16, torch.float32, 16, str(tmp_path))
    assert (choice.backend.name, choice.reason, choice.fallback_reason) == ("triton", "requested", "")
