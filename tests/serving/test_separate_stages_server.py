"""A stage on a tritonserver of its own (the front door's `stage_endpoints` setting, OMNI_STAGE_ENDPOINTS): the tts
stage served by a second tritonserver answers /v1/audio/speech through a front door whose chat goes to the first;
once the second server is killed, speech gets 503 naming the stage, chat answers as before and /health says which
stage is missing."""

from __future__ import annotations

import json

import pytest
import tritonclient.grpc as grpcclient
from helpers import frontdoor_http
from helpers.front_door import FrontDoorThread, front_door_config
from helpers.http_calls import MODEL, post, post_json
from helpers.triton_server import serve_models

from omni_backend.stages import tts_audio

pytestmark = pytest.mark.server

CHAT_MODELS = ["preprocess", "llm", "postprocess", "omni_chat"]
# A down server is refused by gRPC at once; this bound only keeps a hang from stalling the run (never reached)
FAIL_FAST_BOUND_S = 10
SPEECH = {"model": "tts-1", "input": "Hello from the second server.", "voice": "alloy", "response_format": "wav"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
        "temperature": 0}


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    with serve_models(tmp_path_factory.mktemp("triton-chat"), CHAT_MODELS, dtype="float32",
                      kv_cache_bytes=32 * 1024 * 1024, max_num_seqs=4) as server:
        yield server


@pytest.fixture(scope="module")
def tts_server(tmp_path_factory):
    with serve_models(tmp_path_factory.mktemp("triton-tts"), ["tts"]) as server:
        yield server


def test_a_stage_on_its_own_server_and_its_death(chat_server, tts_server):
    local = grpcclient.InferenceServerClient(chat_server.grpc_url)
    assert not local.is_model_ready("tts")  # so speech can only come from the second server
    door = FrontDoorThread(front_door_config(chat_server, stage_endpoints={"tts": tts_server.grpc_url})).start()
    try:
        status, _, health = frontdoor_http.get(door.url + "/health")
        assert (status, json.loads(health)) == (200, {"status": "ok"})
        status, _, data = post(door.url + "/v1/audio/speech", SPEECH)
        assert status == 200, data
        samples, rate = tts_audio.decode_wav(data)
        assert rate == 22050 and samples.size > rate // 2 and abs(samples.astype(float)).max() > 1000
        status, chat = post_json(door.url + "/v1/chat/completions", CHAT)
        assert status == 200, chat
        answer = chat["choices"][0]["message"]["content"]
        assert answer

        tts_server.stop(grace_s=0)  # SIGKILL: the server and its stub are gone

        status, headers, body = frontdoor_http.post(door.url + "/v1/audio/speech", SPEECH, timeout=FAIL_FAST_BOUND_S)
        assert status == 503 and headers["retry-after"] == "1", body
        error = body["error"]
        assert error["type"] == "server_error" and error["code"] == "service_unavailable"
        assert error["message"].startswith(f"the tts stage is unavailable (its tritonserver at {tts_server.grpc_url})")
        status, again = post_json(door.url + "/v1/chat/completions", CHAT)
        assert status == 200 and again["choices"][0]["message"]["content"] == answer  # greedy: the same words
        status, _, text = frontdoor_http.get(door.url + "/health")
        health = json.loads(text)
        assert status == 200 and health["status"] == "degraded" and list(health["stages_down"]) == ["tts"]
        assert tts_server.grpc_url in health["stages_down"]["tts"]
    finally:
        door.stop()
