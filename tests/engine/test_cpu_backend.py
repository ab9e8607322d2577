"""The engine's CPU default, the C++ decode kernel: chosen automatically on CPU, same tokens as the torch
backend, and a fallback to torch that says why where the kernel cannot be built."""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from kernels.cpu_library import CpuKernelUnavailable
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")


def _config(path: str, backend: str) -> EngineConfig:
    return EngineConfig(model_path=path, dtype="float32", attention_backend=backend, num_kv_blocks=16,
                        block_size=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)


def test_cpu_backend_is_the_cpu_default_and_matches_torch(tiny_qwen2_path):
    prompts = [list(range(200, 219)), list(range(500, 505)), [42]]
    # logprobs: a random tiny model repeats tokens, so compare the distributions' top entries too
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    results = {}
    for backend in ("auto", "torch"):
        engine = LLMEngine(_config(tiny_qwen2_path, backend))
        assert engine.runner.attention_backend == ("cpu" if backend == "auto" else "torch")
        outputs = engine.generate(prompts, params)
        results[backend] = [[(lp.token_id, lp.logprob) for lp in o.logprobs] for o in outputs]
    for cpu_row, torch_row in zip(results["auto"], results["torch"]):
        assert [t for t, _ in cpu_row] == [t for t, _ in torch_row]
        assert [lp for _, lp in cpu_row] == pytest.approx([lp for _, lp in torch_row], abs=1e-4)


def test_unbuildable_kernel_falls_back_to_torch_with_a_warning(tiny_qwen2_path, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with caplog.at_level(logging.WARNING, logger="omni_backend.engine.model_runner"):
        engine = LLMEngine(_config(tiny_qwen2_path, "auto"))
    assert engine.runner.attention_backend == "torch"
    assert "attention backend cpu disabled, using torch: no C++ compiler" in caplog.text
    output = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
    assert output.completion_tokens == 2
    with pytest.raises(CpuKernelUnavailable, match="no C\\+\\+ compiler"):
        LLMEngine(_config(tiny_qwen2_path, "cpu"))
