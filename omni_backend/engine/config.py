"""Engine configuration: model location, KV-cache size and batching limits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
QUANTIZATIONS = ("none", "int8")


@dataclass
class EngineConfig:
    """Settings of one LLM engine instance.

    Attributes:
        model_path: local Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files).
        device: "cpu" or "cuda[:n]".
        dtype: "auto", "float32", "float16" or "bfloat16"; "auto" picks by device (see `ops.hardware`).
        block_size: tokens per KV-cache block.
        kv_cache_bytes: bytes for the KV cache (both K and V, all layers), on CPU and GPU; None: the device's
            default (512 MiB on CPU; on a GPU what `gpu_memory_utilization` leaves, see engine/memory.py).
        gpu_memory_utilization: fraction of the GPU's total memory this engine may use (weights, activations,
            CUDA graphs and KV cache), in (0, 1].
        num_kv_blocks: overrides both budgets when set (tests use tiny caches).
        max_num_seqs: most sequences in one step; also the rows of the block-table pool.
        max_num_batched_tokens: per-step token budget (prefill chunks + decodes), tokens.
        max_model_len: longest prompt + completion, tokens (capped by the model's max positions).
        attention_backend: "auto", "cpu", "torch" or "triton" (see `omni_backend.engine.attention`).
        enforce_eager: never capture CUDA graphs.
        cpu_threads: torch intra-op threads of a CPU engine, set for the whole process; 0: torch's count as it is
            (an offline engine). The llm stage turns its 0 into the usable cores minus one
            (`ops.hardware.cpu_engine_threads`). Ignored on a GPU.
        enable_prefix_caching: reuse the KV blocks of prompt prefixes already computed (engine/prefix_cache.py).
        quantization: "none", or "int8": weight-only int8 projections and output head with one float32 scale per
            output channel, activations in float32 (`kernels/linear_cpu.py`); CPU engines only, with dtype
            "auto" (which then means float32) or "float32".
    """

    model_path: str
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    num_kv_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048
    attention_backend: str = "auto"
    enforce_eager: bool = False
    cpu_threads: int = 0
    enable_prefix_caching: bool = True
    quantization: str = "none"

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be >= 0, got {self.cpu_threads}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization != "none" and self.dtype not in ("auto", "float32"):
            raise ValueError(f"quantization {self.quantization} computes in float32; dtype {self.dtype} is not that")
        if self.quantization != "none" and self.device != "cpu":
            raise ValueError(f"quantization {self.quantization} runs on CPU engines only (device {self.device})")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend}")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def max_blocks_per_seq(self) -> int:
        """Columns of the block-table pool: ceil(max_model_len / block_size)."""
        return -(-self.max_model_len // self.block_size)
