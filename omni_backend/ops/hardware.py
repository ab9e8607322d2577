"""Device capabilities that decide dtypes and kernels.

Rules (by capability, never by model or device name): bf16 needs compute capability >= 8.0 (Ampere; NVIDIA
CUDA C Programming Guide, "Arithmetic Instructions"), fp16 below; OpenAI-Triton kernels need a CUDA device of
capability >= 7.0 (Triton's documented minimum) or the interpreter (TRITON_INTERPRET=1). On CPU the default
is float32: bf16 is faster on CPUs with AMX/AVX512-BF16 but changes greedy tokens, so it is opt-in.
"""

from __future__ import annotations

import os

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def select_dtype(requested: str, device: torch.device) -> torch.dtype:
    """Resolve "auto" or a dtype name to a torch dtype valid on `device`.

    Raises:
        ValueError: unknown name, or bfloat16 requested on a GPU below sm80.
    """
    capability = compute_capability(device)
    if requested == "auto":
        if capability is None:
            return torch.float32
        return torch.bfloat16 if capability >= (8, 0) else torch.float16
    if requested not in DTYPES:
        raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {requested!r}")
    if requested == "bfloat16" and capability is not None and capability < (8, 0):
        raise ValueError(f"bfloat16 needs compute capability >= 8.0, device has {capability}")
    return DTYPES[requested]


def select_attention_backend(requested: str, device: torch.device) -> tuple[str, str]:
    """Resolve "auto"/"torch"/"triton" to a backend name and the reason for the choice.

    Raises:
        ValueError: "triton" requested where the kernels cannot run.
    """
    capability = compute_capability(device)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    triton_ok = (capability is not None and capability >= (7, 0)) or (capability is None and interpreted)
    if requested == "triton":
        if not triton_ok:
            raise ValueError("attention_backend=triton needs a CUDA device with capability >= 7.0 "
                             "or TRITON_INTERPRET=1 on CPU")
        return "triton", "requested"
    if requested == "torch":
        return "torch", "requested"
    if capability is not None and triton_ok:
        return "triton", f"auto: CUDA capability {capability[0]}.{capability[1]}"
    if capability is not None:
        return "torch", f"auto: CUDA capability {capability[0]}.{capability[1]} below 7.0"
    return "torch", "auto: CPU device (Triton kernels only under TRITON_INTERPRET=1, which is slow)"
