"""Engine configuration: every setting of one LLM engine, declared once (omni_backend/settings.py).

The model repository renders these fields into the llm model's `config.pbtxt` parameters and reads them from
`OMNI_<NAME>` (omni_backend/repository.py); the llm stage parses them back with `EngineConfig.from_strings`;
docs/operations.md's settings table is generated from the same declarations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_backend.ops.hardware import resolve_device
from omni_backend.settings import SettingGroup, setting

ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
QUANTIZATIONS = ("none", "int8")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"


@dataclass
class EngineConfig(SettingGroup):
    """Settings of one LLM engine instance (each field's doc is its `setting`'s; cross-field rules below).

    Rules between fields: max_num_batched_tokens >= max_num_seqs; quantization int8 computes in float32 (dtype auto
    or float32) on CPU engines only, without tensor parallelism. An engine resolves `device` "auto" when it is built (`torch_device`); the llm
    stage resolves it per Triton instance first (stages/llm/parameters.py).

    Raises:
        ValueError: a field outside what its setting allows, or a broken rule between fields (naming them).
    """

    model_path: str = setting("", "checkpoint folder in Hugging Face layout (config.json, safetensors, tokenizer)",
                              name="llm_model_path")
    device: str = setting("auto", "auto (cuda when torch can use it, else cpu), cpu, cuda (one llm engine per GPU) "
                          "or cuda:N", pattern=DEVICE_PATTERN, forms="auto, cpu, cuda or cuda:N")
    dtype: str = setting("auto", "weights and activations; auto picks by device (ops/hardware.py), on CPUs with native "
                         "bfloat16 by measuring (engine/cpu_dtype.py)", choices=DTYPES)
    block_size: int = setting(16, "tokens per KV-cache block", choices=(8, 16, 32, 64, 128))
    kv_cache_bytes: int = setting(0, "paged KV cache (K and V, all layers), bytes; 0: 512 MiB on CPU, on a GPU what "
                                  "gpu_memory_utilization leaves (engine/memory.py)", low=0)
    gpu_memory_utilization: float = setting(0.75, "share of each GPU its llm engine may use (weights, activations, "
                                            "CUDA graphs, KV cache)", low=0.0, low_open=True, high=1.0)
    num_kv_blocks: int | None = setting(None, "KV blocks, overriding both budgets (tests use tiny caches)", kind=int,
                                        low=1, optional=True, operator=False)
    max_num_seqs: int = setting(32, "most sequences in one step; also the rows of the block-table pool", low=1)
    max_num_batched_tokens: int = setting(1024, "per-step token budget (prefill chunks + decodes)", low=1)
    max_model_len: int = setting(2048, "longest prompt + completion, tokens (capped by the model's max positions)",
                                 low=1)
    attention_backend: str = setting("auto", "auto, cpu, torch or triton (engine/attention/selector.py)",
                                     choices=ATTENTION_BACKENDS)
    enforce_eager: bool = setting(False, "true: never capture CUDA graphs (decode runs eagerly)")
    cpu_threads: int = setting(0, "a CPU engine's torch threads; 0: in the llm stage the usable cores minus one "
                               "(at least 1), a core left for tritonserver and the front door; offline: torch's "
                               "count as it is", low=0)
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of prompt prefixes already computed "
                                          "(engine/prefix_cache.py)")
    talker: bool = setting(False, "run the checkpoint's talker (codec tokens out of a thinker's reply: Qwen2.5-Omni) "
                           "instead of its language model; the talker stage's engine", operator=False)
    quantization: str = setting("none", "int8: weight-only int8 projections and output head, 8-bit codes with a "
                                "float32 scale and minimum per 32 inputs of a row (CPU engines of dtype float32; "
                                "VNNI CPUs round the inputs to 15 bits per 32; kernels/linear_int8.cpp)",
                                choices=QUANTIZATIONS)
    tensor_parallel_size: int = setting(1, "ranks that split the model's attention heads and MLP "
                                        "(engine/tensor_parallel.py): this process is rank 0 and spawns the others; "
                                        "CPU ranks share cpu_threads, GPU ranks take cuda:i..i+N-1 and need "
                                        "enforce_eager; every CPU rank runs the torch modules, not the C++ CPU step",
                                        low=1)
    grammar_compile_timeout_s: float = setting(10.0, "longest wait for a request's grammar (structured output) to "
                                               "compile, seconds; past it the request is refused (400)", low=0.0,
                                               low_open=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model_path:
            raise ValueError("setting model_path is required (a checkpoint folder)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("need max_num_batched_tokens >= max_num_seqs")
        if self.quantization != "none" and self.dtype not in ("auto", "float32"):
            raise ValueError(f"quantization {self.quantization} computes in float32; dtype {self.dtype} is not that")
        if self.quantization != "none" and self.tensor_parallel_size > 1:
            raise ValueError(f"quantization {self.quantization} runs in the C++ CPU step, which cannot shard; "
                             f"tensor_parallel_size {self.tensor_parallel_size} is not that")
        if self.quantization != "none" and self.device not in ("cpu", "auto"):
            raise ValueError(f"quantization {self.quantization} runs on CPU engines only (device {self.device})")

    @property
    def torch_device(self) -> torch.device:
        """The engine's device, "auto" resolved (ops.hardware.resolve_device: CUDA when torch can use it).

        Raises:
            RuntimeError: an explicit CUDA device torch cannot use.
        """
        return torch.device(resolve_device(self.device))

    @property
    def max_blocks_per_seq(self) -> int:
        """Columns of the block-table pool: ceil(max_model_len / block_size)."""
        return -(-self.max_model_len // self.block_size)
