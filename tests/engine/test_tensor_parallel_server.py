"""The llm stage with tensor_parallel_size 2 inside tritonserver: its engine, in Triton's Python stub, spawns its
second rank, answers with the greedy text of an offline one-rank engine, and the rank is gone after the server."""

from __future__ import annotations

import pytest
from helpers.llm_stream import LLMStream, llm_inputs, preprocessed
from helpers.processes import descendants, gone
from helpers.triton_server import serve_models

from omni_backend import paths
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams

SMOLLM2 = str(paths.models_dir() / "SmolLM2-135M-Instruct")
SETTINGS = {"llm_model_path": SMOLLM2, "device": "cpu", "dtype": "float32", "kv_cache_bytes": 32 << 20,
            "max_num_seqs": 4, "tensor_parallel_size": 2}
PROMPT = "What is the capital of France?"


@pytest.mark.server
def test_the_llm_stage_serves_with_two_cpu_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-tp")
    server = serve_models(root, ["preprocess", "llm"], **SETTINGS)
    try:
        ranks = [pid for pid, line in descendants(server.process.pid).items() if "spawn_main" in line]
        assert len(ranks) == 1  # the llm instance's second rank
        arrays = preprocessed(server.grpc_url, PROMPT, 12)
        stream = LLMStream(server.grpc_url)
        stream.send(llm_inputs(server.grpc_url, PROMPT, 12))
        served = stream.collect()
    finally:
        server.stop()
    assert gone(ranks[0], within_s=30)
    engine = LLMEngine(EngineConfig(model_path=SMOLLM2, dtype="float32", kv_cache_bytes=32 << 20))
    params = SamplingParams.from_json(arrays["sampling_params"].reshape(-1)[0].decode())
    expected = engine.generate([arrays["input_ids"].reshape(-1).tolist()], params)[0]
    assert served["error"] is None and served["finish_reason"] == "length"
    assert served["text"] == expected.text and served["tokens"] == 12
