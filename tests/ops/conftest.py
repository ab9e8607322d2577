"""Fixtures for ops tests: a tiny random Llama for governor tests on a real engine, and a tritonserver whose
llm stage sees a fake GPU (`OMNI_NVML_FAKE`: a JSON file re-read at every governor reading)."""

from __future__ import annotations

import json

import pytest
import torch

from omni_backend import paths, repository
from omni_backend.launch.ports import free_ports
from omni_backend.launch.tritonserver import TritonServer

FAKE_GPU = {"power_w": 120, "temperature_c": 50, "power_limit_w": 300, "slowdown_temp_c": 90, "sm_clock_mhz": 1755}


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    """A 1-layer random Llama, fast enough that an engine step costs about a millisecond."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    smollm2 = paths.models_dir() / "SmolLM2-135M-Instruct"
    if not (smollm2 / "tokenizer.json").exists():
        pytest.fail(f"{smollm2} missing: run scripts/setup.sh")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def governed_server(tmp_path_factory):
    """The omni_chat pipeline, a KV cache of 512 MiB (8 sequences of 1,024 tokens fit: test_metrics_server.py's
    held requests), 8 sequences per step, the fake GPU above, and the llm stage's KV events on an ipc endpoint
    (`server.kv_events`)."""
    root = tmp_path_factory.mktemp("governed")
    nvml_file = root / "nvml.json"
    nvml_file.write_text(json.dumps(FAKE_GPU))
    kv_events = f"ipc://{root}/kv-events"
    repository.render_repository(root / "model_repository", models=["preprocess", "llm", "postprocess", "omni_chat"],
                                 kv_cache_bytes=512 << 20, max_num_seqs=8, kv_events=kv_events)
    http, grpc, metrics = free_ports(3)
    server = TritonServer(root / "model_repository", http_port=http, grpc_port=grpc, metrics_port=metrics,
                          exit_timeout_s=5, log_file=root / "tritonserver.log",
                          env={"TRITON_INTERPRET": None, "OMNI_NVML_FAKE": str(nvml_file)})
    server.start(ready_timeout_s=300)
    server.nvml_file, server.fake_gpu, server.kv_events = nvml_file, dict(FAKE_GPU), kv_events
    yield server
    server.stop()
