"""dtype "auto" on CPUs with native bfloat16, decided by measurement (engine/cpu_dtype.py): the rule, the timing of
every path this CPU has, the cache keyed by CPU and torch, the engine obeying the choice and an explicit dtype."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from omni_backend import paths
from omni_backend.engine import cpu_dtype
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.ops.hardware import DTYPES, cpu_has_native_bf16

SHAPE = cpu_dtype.LayerShape(hidden=64, qkv=128, q=64, intermediate=128)
KERNELS = paths.cache_dir() / "kernels"  # the engine's builds, shared


def test_the_fastest_by_geometric_mean_over_the_batch_range():
    seconds = {"float32": {1: 10.0, 32: 100.0}, "bfloat16": {1: 6.0, 32: 50.0},
               "bfloat16-onednn": {1: 8.0, 32: 40.0}}  # geometric means 31.6, 17.3, 17.9
    assert cpu_dtype.pick(seconds) == "bfloat16"
    seconds["bfloat16-onednn"][32] = 30.0  # 15.5
    assert cpu_dtype.pick(seconds) == "bfloat16-onednn"
    assert cpu_dtype.pick({"bfloat16-onednn": {1: 1.0}, "float32": {1: 1.0}}) == "float32"  # a tie: PATHS order
    with pytest.raises(ValueError, match="no path"):
        cpu_dtype.pick({})


def test_layer_shape_of_a_gqa_config():
    class Config:  # SmolLM2-135M's sizes
        hidden_size, num_attention_heads, num_key_value_heads, intermediate_size = 576, 9, 3, 1536

    shape = cpu_dtype.LayerShape.of(Config())
    assert shape == cpu_dtype.LayerShape(576, (9 + 6) * 64, 576, 1536)
    assert shape.weights() == [(960, 576), (576, 576), (3072, 576), (576, 1536)]


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="the CPU has no native bfloat16: auto is float32 by device")
def test_choose_measures_every_path_once_then_reads_the_cache(tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="omni_backend.engine.cpu_dtype"):
        first = cpu_dtype.choose(SHAPE, 8, KERNELS, tmp_path)
    assert not first.cached and set(first.seconds) == set(cpu_dtype.PATHS)
    assert all(set(by_batch) == {1, 8} and min(by_batch.values()) > 0 for by_batch in first.seconds.values())
    assert first.path == cpu_dtype.pick(first.seconds)
    assert first.dtype == (torch.float32 if first.path == "float32" else torch.bfloat16)
    assert f"dtype auto: measured fastest {first.path} (" in caplog.text
    stored = json.loads((tmp_path / cpu_dtype.CACHE_FILE).read_text())
    [(key, entry)] = stored.items()
    assert torch.__version__ in key and cpu_dtype.kernels_build(KERNELS) in key and entry["path"] == first.path

    def no_measuring(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(cpu_dtype, "measure", no_measuring)
    second = cpu_dtype.choose(SHAPE, 8, KERNELS, tmp_path)
    assert second.cached and second.path == first.path and second.seconds == first.seconds
    assert second.reason.startswith("auto: measured (cached) fastest")
    monkeypatch.setattr(cpu_dtype, "kernels_build", lambda build_dir: "linear_cpu-another.so")  # changed kernels
    with pytest.raises(AssertionError, match="measured again"):
        cpu_dtype.choose(SHAPE, 8, KERNELS, tmp_path)
    monkeypatch.undo()
    monkeypatch.setattr(cpu_dtype, "measure", no_measuring)
    assert cpu_dtype.choose(SHAPE, 8, KERNELS, tmp_path).cached  # the same kernels again: read from the cache
    monkeypatch.setattr(torch, "__version__", "0.0.0-another")  # another torch: measured again
    with pytest.raises(AssertionError, match="measured again"):
        cpu_dtype.choose(SHAPE, 8, KERNELS, tmp_path)


def test_an_unreadable_cache_is_measured_again(tmp_path, monkeypatch, caplog):
    (tmp_path / cpu_dtype.CACHE_FILE).write_text("{not json")
    monkeypatch.setattr(cpu_dtype, "measure", lambda *a: {"float32": {1: 2.0}, "bfloat16": {1: 1.0}})
    with caplog.at_level(logging.WARNING, logger="omni_backend.engine.cpu_dtype"):
        choice = cpu_dtype.choose(SHAPE, 1, KERNELS, tmp_path)
    assert choice.path == "bfloat16" and "cannot read" in caplog.text
    assert json.loads((tmp_path / cpu_dtype.CACHE_FILE).read_text())  # rewritten whole


@pytest.mark.parametrize("chosen,matmuls", [("float32", "cpu-kernels-float32"), ("bfloat16", "cpu-kernels-bfloat16"),
                                            ("bfloat16-onednn", "onednn-packed")])
def test_the_engine_runs_the_measured_choice_and_obeys_an_explicit_dtype(tiny_qwen2_path, monkeypatch, chosen,
                                                                         matmuls):
    if chosen == "bfloat16" and "avx512_bf16" not in cpu_dtype.cpu_features().split():
        pytest.skip("the C++ bfloat16 step needs AVX512-BF16")
    # as on a CPU with native bfloat16, whatever this one has; the choice as measured (choose's own tests above)
    monkeypatch.setattr("omni_backend.engine.model_runner.select_dtype",
                        lambda requested, device: torch.bfloat16 if requested == "auto" else DTYPES[requested])
    monkeypatch.setattr(cpu_dtype, "choose", lambda *a: cpu_dtype.CpuDtypeChoice(chosen, {chosen: {1: 1.0}}, False))
    config = dict(model_path=tiny_qwen2_path, kv_cache_bytes=8 << 20, max_num_batched_tokens=64, max_model_len=128)
    engine = LLMEngine(EngineConfig(dtype="auto", **config))
    runner = engine.runner
    assert runner.matmuls == matmuls
    assert runner.dtype == runner.kv_caches[0][0].dtype == (torch.float32 if chosen == "float32" else torch.bfloat16)
    assert runner.dtype_reason == f"auto: measured fastest {chosen} ({chosen} b1 1000.00 ms per layer)"
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0] \
        .completion_tokens == 3
    monkeypatch.setattr(cpu_dtype, "choose", lambda *a: pytest.fail("an explicit dtype is measured"))
    explicit = LLMEngine(EngineConfig(dtype="float32", **config)).runner
    assert explicit.dtype == torch.float32 and explicit.dtype_reason == "configured"
