"""Which attention backend the engine runs: decided once, at start-up, with the reason.

The first choice goes by capability, never by device or model name (`first_choice`):

- "auto": triton on a CUDA device of capability >= 7.0 (Triton's documented minimum), torch below that, cpu on a
  CPU (the Triton kernels run on a CPU only under TRITON_INTERPRET=1, and only when asked for: the interpreter is
  slow);
- "triton": where the Triton kernels can run (as above, or TRITON_INTERPRET=1 on a CPU);
- "cpu": on a CPU device; "torch": anywhere.

On a CUDA device the triton choice also needs a C compiler and the Python headers, with which OpenAI Triton builds
its kernel launchers (ops/triton_build.py); this is checked before any kernel runs: without them an explicit
"triton" is refused with what is missing and how to install it, and "auto" falls back to torch with that as a
WARNING and as the fallback reason.

Then the choice is built (the cpu backend compiles its C++ kernel on first use, so whether it can is only known
now) and, unless it is the torch reference itself, runs its self-test against torch (`self_test.py`). An automatic
choice that cannot be built or fails the self-test falls back to torch with a WARNING naming why (and, for a failed
self-test, the versions); an explicitly requested one raises. The outcome is logged once and kept in the
`AttentionChoice`, whose name, reason and fallback reason the llm stage publishes as the `omni_runtime_info`
labels attention_backend, attention_reason and fallback_reason (stages/llm/build.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from kernels.cpu_library import CpuKernelUnavailable
from omni_backend.engine.attention.cpu_backend import CpuAttention
from omni_backend.engine.attention.interface import AttentionBackend
from omni_backend.engine.attention.self_test import self_test
from omni_backend.engine.attention.torch_backend import TorchAttention
from omni_backend.engine.attention.triton_backend import TritonAttention
from omni_backend.ops.hardware import compute_capability, runtime_versions
from omni_backend.ops.triton_build import launcher_problems_here, problem_message

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {b.name: b for b in (CpuAttention, TorchAttention, TritonAttention)}


@dataclass(frozen=True)
class AttentionChoice:
    """The attention backend the engine runs and why.

    Attributes:
        backend: the built (and self-tested) backend.
        reason: why it was chosen ("requested", "auto: CPU device (...)", "auto: cpu failed its self-test").
        fallback_reason: why it is not the first choice ("" when it is): the build error or the self-test failure.
    """

    backend: AttentionBackend
    reason: str
    fallback_reason: str = ""


def first_choice(requested: str, device: torch.device, capability: tuple[int, int] | None) -> tuple[str, str]:
    """Resolve "auto"/"cpu"/"torch"/"triton" to a backend name and the reason (the rules in the module docstring).

    Args:
        capability: the CUDA device's (major, minor), None for a CPU (`ops.hardware.compute_capability`).

    Raises:
        ValueError: "triton" requested where the kernels cannot run, "cpu" requested for a CUDA device, or a name
            that is none of these.
    """
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    triton_ok = (capability is not None and capability >= (7, 0)) or (capability is None and interpreted)
    if requested == "triton":
        if not triton_ok:
            raise ValueError("attention_backend=triton needs a CUDA device with capability >= 7.0 "
                             "or TRITON_INTERPRET=1 on CPU")
        return "triton", "requested"
    if requested == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend=cpu runs on CPU tensors, the engine's device is {device}")
        return "cpu", "requested"
    if requested == "torch":
        return "torch", "requested"
    if requested != "auto":
        raise ValueError(f"unknown attention backend {requested!r}; choose auto, {', '.join(sorted(BACKENDS))}")
    if capability is not None and triton_ok:
        return "triton", f"auto: CUDA capability {capability[0]}.{capability[1]}"
    if capability is not None:
        return "torch", f"auto: CUDA capability {capability[0]}.{capability[1]} below 7.0"
    return "cpu", "auto: CPU device (C++ paged decode kernel; Triton kernels only under TRITON_INTERPRET=1)"


def select_attention(requested: str, device: torch.device, num_q_heads: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, block_size: int, kernel_build_dir: str) -> AttentionChoice:
    """The attention backend for a model of these head shapes and dtype on `device` (see the module docstring).

    Args:
        requested: the `attention_backend` setting: "auto", "cpu", "torch" or "triton".
        kernel_build_dir: where the cpu backend's kernel is compiled.

    Raises:
        ValueError: a request `first_choice` refuses.
        CpuKernelUnavailable: "cpu" was requested explicitly and its kernel cannot be built here.
        RuntimeError: an explicitly requested backend fails its self-test, or "triton" on a CUDA device where
            Triton cannot build its kernel launchers (the message names what is missing and how to install it).
    """
    name, reason = first_choice(requested, device, compute_capability(device))
    scale = head_dim ** -0.5
    fallback = ""
    if name == "triton" and device.type == "cuda" and launcher_problems_here():
        message = problem_message(launcher_problems_here())
        if requested != "auto":
            raise RuntimeError(f"attention_backend=triton cannot run on {device}: {message}")
        logger.warning("attention backend triton disabled, using torch (eager, no CUDA graphs): %s", message)
        name, reason = "torch", "auto: Triton cannot build its kernel launchers here"
        fallback = f"triton kernel launchers: {message}"
    try:
        backend = BACKENDS[name](scale, kernel_build_dir)
    except CpuKernelUnavailable as exc:
        if requested != "auto":
            raise
        logger.warning("attention backend cpu disabled, using torch: %s", exc)
        backend, reason = TorchAttention(scale), "auto: the C++ attention kernels cannot be built here"
        fallback = f"cpu kernel unavailable: {exc}"
    if backend.name != "torch":
        failure = self_test(backend, num_q_heads, num_kv_heads, head_dim, dtype, device, block_size)
        if failure is not None:
            versions = ", ".join(f"{k} {v or '-'}" for k, v in runtime_versions().items())
            message = f"attention backend {backend.name} failed its self-test on {device} ({failure}); {versions}"
            if requested != "auto":
                raise RuntimeError(message)
            logger.warning("%s: falling back to the torch backend (eager, no CUDA graphs)", message)
            reason, fallback = f"auto: {backend.name} failed its self-test", f"self-test of {backend.name}: {failure}"
            backend = TorchAttention(scale)
    logger.info("attention backend: %s (%s)", backend.name, reason)
    return AttentionChoice(backend, reason, fallback)
