"""Hugging Face multimodal folders served through the real tritonserver (issue 17): with the llm's model path at a
tiny random Idefics3, LLaVA or Qwen2-Audio checkpoint (and nothing else configured), a chat with the astronaut
photo or Piper's spoken question answers transformers' greedy `generate` token for token (float32), through the
OpenAI front door and through the `omni_chat_mm` ensemble."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
from helpers.chat_client import stream_infer
from hf_reference import KIND, messages, transformers_greedy, transformers_inputs, transformers_model

from omni_backend import repository
from omni_backend.launch.ports import free_ports
from omni_backend.launch.tritonserver import TritonServer
from omni_backend.setup.tiny_hf_multimodal import build

pytestmark = pytest.mark.server

MODELS = ["preprocess", "llm", "postprocess", "omni_chat", "vision_encoder", "audio_encoder", "media_embed",
          "omni_chat_mm"]
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=tuple(KIND))
def served(request, tmp_path_factory):
    """(architecture, checkpoint folder, front door URL, tritonserver) for each architecture in turn."""
    import uvicorn

    from omni_backend.serving import ServingConfig, create_app

    architecture = request.param
    root = tmp_path_factory.mktemp(f"hf-{architecture}")
    folder = str(build(architecture, root / "checkpoint", log=lambda _: None))
    repository.render_repository(root / "model_repository", models=MODELS, dtype="float32", llm_model_path=folder,
                                 kv_cache_bytes=16 * 1024 * 1024, max_num_seqs=4, max_model_len=1024)
    http, grpc, metrics, port = free_ports(4)
    server = TritonServer(root / "model_repository", http_port=http, grpc_port=grpc, metrics_port=metrics,
                          exit_timeout_s=5, log_file=root / "tritonserver.log", env={"TRITON_INTERPRET": None})
    server.start(ready_timeout_s=300)
    config = ServingConfig(triton_grpc=server.grpc_url, triton_http=server.http_url,
                           triton_metrics_url=server.metrics_url, port=port, host="127.0.0.1")
    front = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=front.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not front.started:
        assert time.monotonic() < deadline and thread.is_alive(), "front door did not start"
        time.sleep(0.05)
    yield architecture, folder, f"http://127.0.0.1:{port}", server
    front.should_exit = True
    thread.join(timeout=10)
    server.stop()


def test_chat_with_media_answers_transformers_greedy_tokens(served):
    from transformers import AutoTokenizer

    architecture, folder, url, server = served
    inputs = transformers_inputs(architecture, folder)
    expected = transformers_greedy(transformers_model(architecture, folder), inputs, NEW_TOKENS)
    expected_text = AutoTokenizer.from_pretrained(folder).decode(expected, skip_special_tokens=True)
    chat = messages(architecture)
    body = {"model": "omni_chat", "messages": chat, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["message"]["content"] == expected_text
    assert answer["usage"] == {**answer["usage"], "prompt_tokens": inputs["input_ids"].shape[1],
                               "completion_tokens": NEW_TOKENS}

    values = {"text_input": json.dumps(chat), "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    result = stream_infer(server.grpc_url, values, model="omni_chat_mm")
    assert result.error is None, result.error
    assert result.text == expected_text


def test_media_the_model_does_not_read_is_a_400_and_the_next_request_works(served):
    architecture, _, url, _ = served
    other = "llava" if architecture == "qwen2_audio" else "qwen2_audio"
    body = {"model": "omni_chat", "messages": messages(other), "max_tokens": 2}
    response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "encoder" in error["message"], error
    body["messages"] = messages(architecture)
    assert requests.post(f"{url}/v1/chat/completions", json=body, timeout=300).status_code == 200
