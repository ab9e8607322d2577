"""Device capabilities that decide dtypes and kernels.

Rules (by capability, never by model or device name): bf16 needs compute capability >= 8.0 (Ampere; NVIDIA
CUDA C Programming Guide, "Arithmetic Instructions"), fp16 below; OpenAI-Triton kernels need a CUDA device of
capability >= 7.0 (Triton's documented minimum) or the interpreter (TRITON_INTERPRET=1). On CPU the default
is bfloat16 where the CPU has native bf16 matrix math (AMX-BF16 or AVX512-BF16 in /proc/cpuinfo; measured
here: a 1024-token SmolLM2 prefill step about 5x faster than float32), float32 elsewhere. Greedy-equality
tests pin float32.
"""

from __future__ import annotations

import os

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_has_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises AMX-BF16 or AVX512-BF16 (Linux /proc/cpuinfo flags)."""
    try:
        with open(cpuinfo_path, encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return any(flag in line.split() for flag in CPU_BF16_FLAGS)
    except OSError:
        return False
    return False


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
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
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
