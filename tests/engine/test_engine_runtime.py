"""The engine's start-up, on CPU: KV-cache sizing rules, the attention self-test and its fallback, split-KV plans
per decode batch size, weights in their final dtype."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels.paged_decode import default_num_splits
from kernels.paged_decode_cpu import CpuPagedDecode
from kernels.paged_prefill_cpu import CpuPagedPrefill
from omni_backend.engine.attention.selector import BACKENDS
from omni_backend.engine.attention.self_test import self_test
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.memory import GPU_HEADROOM_BYTES, MIB, GpuMemoryProfile, plan_kv_cache
from omni_backend.engine.sampling_params import SamplingParams

GIB = 1024 * MIB


def _config(path: str, **overrides) -> EngineConfig:
    values = dict(model_path=path, dtype="float32", num_kv_blocks=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, max_model_len=128)
    values.update(overrides)
    return EngineConfig(**values)


# --- KV-cache sizing ------------------------------------------------------------------------------------------

def test_kv_plan_explicit_settings_win_and_cpu_defaults_to_512_mib():
    assert plan_kv_cache(MIB, num_kv_blocks=7, kv_cache_bytes=64 * MIB).num_blocks == 7
    assert plan_kv_cache(MIB, kv_cache_bytes=64 * MIB).num_blocks == 64
    assert plan_kv_cache(MIB, kv_cache_bytes=64 * MIB, gpu=GpuMemoryProfile(80 * GIB, 70 * GIB, GIB, GIB, 0),
                         ).num_blocks == 64  # OMNI_KV_CACHE_BYTES is honoured on a GPU too
    assert plan_kv_cache(MIB).num_blocks == 512


def test_kv_plan_on_a_gpu_is_the_utilisation_share_less_the_profiled_peak_and_the_graph_pool():
    # 80 GiB, 0.5 of it for this engine; weights 16 GiB, profiled step peaks 4 GiB above them; graphs 1 GiB
    profile = GpuMemoryProfile(total=80 * GIB, free=60 * GIB, peak_torch=20 * GIB, weights=16 * GIB,
                               graph_pool=GIB)
    plan = plan_kv_cache(MIB, gpu=profile, gpu_memory_utilization=0.5)
    assert plan.bytes == 40 * GIB - 20 * GIB - GIB - GPU_HEADROOM_BYTES
    assert "utilisation share" in plan.reason


def test_kv_plan_on_a_gpu_never_takes_more_than_is_free():
    # another stage already holds most of the GPU: only 10 GiB free, of which activations need 4 and graphs 1
    profile = GpuMemoryProfile(total=80 * GIB, free=10 * GIB, peak_torch=20 * GIB, weights=16 * GIB,
                               graph_pool=GIB)
    plan = plan_kv_cache(MIB, gpu=profile, gpu_memory_utilization=0.9)
    assert plan.bytes == 10 * GIB - 4 * GIB - GIB - GPU_HEADROOM_BYTES
    assert "free memory" in plan.reason


def test_kv_plan_without_room_for_a_block_says_what_to_change():
    profile = GpuMemoryProfile(total=16 * GIB, free=GIB, peak_torch=15 * GIB, weights=14 * GIB, graph_pool=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_kv_cache(MIB, gpu=profile, gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match=r"setting gpu_memory_utilization must be a number in \(0, 1\], got 1.5"):
        EngineConfig(model_path="x", gpu_memory_utilization=1.5)


# --- attention self-test and fallback ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 16)])  # SmolLM2-135M's heads, and a small GQA
def test_self_test_passes_for_the_triton_and_cpu_backends(heads, dtype, tmp_path):
    q_heads, kv_heads, head_dim = heads
    for backend in ("triton", "cpu"):  # triton: the interpreter on CPU (tests/conftest.py sets it)
        if backend == "cpu" and dtype == torch.float16:
            continue  # the CPU engine runs float32 or bfloat16
        attention = BACKENDS[backend](head_dim ** -0.5, str(tmp_path))
        assert self_test(attention, q_heads, kv_heads, head_dim, dtype, torch.device("cpu"), 16) is None, backend


def test_the_self_test_runs_the_cpu_steps_float32_query_prefill_over_bfloat16(tmp_path, monkeypatch):
    """Over a bfloat16 cache the C++ CPU step prefills with float32 queries (the C++ prefill kernel, on AVX512-BF16
    CPUs perhaps its vdpbf16ps path); the self-test runs that path too, so a wrong prefill kernel fails it."""
    attention = BACKENDS["cpu"](64 ** -0.5, str(tmp_path))
    assert self_test(attention, 9, 3, 64, torch.bfloat16, torch.device("cpu"), 16) is None
    monkeypatch.setattr(CpuPagedPrefill, "__call__", lambda self, query, *args: torch.zeros_like(query))
    failure = self_test(attention, 9, 3, 64, torch.bfloat16, torch.device("cpu"), 16)
    assert failure.startswith("float32-query prefill differs from the torch reference by"), failure
    assert self_test(attention, 9, 3, 64, torch.float32, torch.device("cpu"), 16).startswith("output differs")


def test_a_wrong_kernel_fails_the_self_test_and_auto_falls_back_to_torch(tiny_qwen2_path, monkeypatch, caplog):
    def wrong(self, query, *args, **kwargs):
        return torch.zeros_like(query)

    monkeypatch.setattr(CpuPagedDecode, "__call__", wrong)
    with caplog.at_level(logging.WARNING, logger="omni_backend.engine.model_runner"):
        engine = LLMEngine(_config(tiny_qwen2_path))
    assert engine.runner.attention_backend == "torch"
    assert engine.runner.fallback_reason.startswith("self-test of cpu: output differs from the torch reference")
    assert "attention backend cpu failed its self-test" in caplog.text
    assert f"torch {torch.__version__}" in caplog.text  # the warning names the versions
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert out.completion_tokens == 3
    with pytest.raises(RuntimeError, match="failed its self-test"):
        LLMEngine(_config(tiny_qwen2_path, attention_backend="cpu"))  # explicit: fail loudly


# --- split-KV plans, dtype -------------------------------------------------------------------------------------

def test_decode_split_count_and_workspace_are_fixed_per_captured_batch_size(tiny_qwen2_path):
    engine = LLMEngine(_config(tiny_qwen2_path, attention_backend="triton", max_num_seqs=8))
    runner = engine.runner
    capacity = runner.config.max_blocks_per_seq * runner.config.block_size
    for rows, bucket in ((1, 1), (3, 4), (4, 4), (5, 8), (8, 8)):
        splits, workspace = runner._decode_plan(rows)
        assert splits == default_num_splits(bucket, runner.num_kv_heads, capacity)
        assert workspace.max_logit.shape == (bucket, runner.num_q_heads, splits)
        assert runner._decode_plan(bucket)[1] is workspace  # one workspace per batch size, reused
    cpu = LLMEngine(_config(tiny_qwen2_path)).runner
    assert cpu._decode_plan(3) == (None, None)  # only the triton kernel splits


def test_weights_are_built_in_their_final_dtype(tiny_qwen2_path):
    runner = LLMEngine(_config(tiny_qwen2_path, dtype="bfloat16")).runner
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert runner.model.cos_cache.dtype == torch.float32  # RoPE tables stay float32 (cast per step)
