"""Each GPU stage's share of device memory.

Several Python-backend stages may share one GPU (llm, vision_encoder, audio_encoder, diffusion), each in its own
stub process with its own PyTorch caching allocator, and whichever loads first could otherwise take what the
others need. Each stage therefore caps its process at a fraction of the device's total memory
(`torch.cuda.set_per_process_memory_fraction`: the caching allocator raises torch.OutOfMemoryError instead of
growing past it), and the llm engine sizes its KV cache inside its own fraction (`gpu_memory_utilization`,
engine/memory.py). The fractions are settings (omni_backend/repository.py) whose defaults sum below 1, leaving
room for the CUDA contexts of every process and Triton's own pinned and CUDA memory pools.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def apply_gpu_memory_budget(device: str, fraction: float, stage: str) -> None:
    """Cap this process's use of `device` at `fraction` of its total memory; nothing on CPU.

    Args:
        device: the stage's torch device ("cpu", "cuda", "cuda:N").
        fraction: share of the device's total memory, in (0, 1].
        stage: the model's name, for the log.

    Raises:
        ValueError: fraction outside (0, 1].
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"{stage}: the GPU memory fraction must be in (0, 1], got {fraction}")
    import torch

    target = torch.device(device)
    if target.type != "cuda":
        return
    torch.cuda.set_per_process_memory_fraction(fraction, target)
    total = torch.cuda.get_device_properties(target).total_memory
    logger.info("%s: GPU memory budget %.2f of %s (%.1f GiB)", stage, fraction, target, fraction * total / 2**30)
