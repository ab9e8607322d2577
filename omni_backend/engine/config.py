"""Engine configuration: model location, KV-cache size and batching limits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIB = 1024 * 1024
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")


@dataclass
class EngineConfig:
    """Settings of one LLM engine instance.

    Attributes:
        model_path: local Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files).
        device: "cpu" or "cuda[:n]".
        dtype: "auto", "float32", "float16" or "bfloat16"; "auto" picks by device (see `ops.hardware`).
        block_size: tokens per KV-cache block.
        kv_cache_bytes: bytes for the KV cache on CPU (both K and V, all layers).
        gpu_memory_utilization: fraction of free GPU memory given to the KV cache after weights load.
        num_kv_blocks: overrides both budgets when set (tests use tiny caches).
        max_num_seqs: most sequences in one step; also the rows of the block-table pool.
        max_num_batched_tokens: per-step token budget (prefill chunks + decodes), tokens.
        max_model_len: longest prompt + completion, tokens (capped by the model's max positions).
        attention_backend: "auto", "cpu", "torch" or "triton" (see `omni_backend.engine.attention`).
        enforce_eager: never capture CUDA graphs.
    """

    model_path: str
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int = 512 * MIB
    gpu_memory_utilization: float = 0.85
    num_kv_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048
    attention_backend: str = "auto"
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs")
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
