"""The tiny Qwen2.5-Omni folder served through the real tritonserver (issue 26): with the llm's model path at it
(and nothing else configured), chats with text, the astronaut photo, Piper's spoken question, a video and a video
with its audio track answer transformers' greedy `generate` token for token (float32), through the OpenAI front
door and through the `omni_chat_mm` ensemble; a video over a limit or in a damaged container is a 400 naming the
part, and the next request works."""

from __future__ import annotations

import json

import pytest
import requests
from helpers.chat_client import stream_infer
from helpers.front_door import FrontDoorThread, front_door_config
from helpers.media_inputs import video_bytes, video_part
from helpers.triton_server import start_tritonserver
from omni_reference import (CASES, NEW_TOKENS, VIDEO_FPS, clip_frames, messages, transformers_greedy,
                            transformers_inputs, transformers_reference)

from omni_backend import repository
from omni_backend.setup.tiny_hf_multimodal import build

pytestmark = pytest.mark.server

MODELS = ["preprocess", "llm", "postprocess", "omni_chat", "vision_encoder", "audio_encoder", "media_embed",
          "omni_chat_mm"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(checkpoint folder, front door URL, tritonserver) of the tiny Qwen2.5-Omni; videos limited to 2 s."""
    root = tmp_path_factory.mktemp("omni-server")
    folder = str(build("qwen2_5_omni", root / "checkpoint", log=lambda _: None))
    repository.render_repository(root / "model_repository", models=MODELS, dtype="float32", llm_model_path=folder,
                                 kv_cache_bytes=16 * 1024 * 1024, max_num_seqs=4, max_model_len=1024)
    config = root / "model_repository" / "preprocess" / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "max_video_seconds" value: { string_value: "2" } }\n')
    server = start_tritonserver(root)
    door = FrontDoorThread(front_door_config(server)).start()
    yield folder, door.url, server
    door.stop()
    server.stop()


def test_chats_answer_transformers_greedy_tokens_through_both_entry_points(served):
    from transformers import AutoTokenizer

    folder, url, server = served
    processor, thinker = transformers_reference(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for case in CASES:
        inputs = transformers_inputs(processor, case)
        expected = tokenizer.decode(transformers_greedy(thinker, inputs, case), skip_special_tokens=True)
        chat = messages(case)
        body = {"model": "omni_chat", "messages": chat, "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True}
        response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, (case, response.text)
        answer = response.json()
        assert answer["choices"][0]["message"]["content"] == expected, case
        assert answer["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1], case
        values = {"text_input": json.dumps(chat), "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
        result = stream_infer(server.grpc_url, values, model="omni_chat_mm")
        assert result.error is None, (case, result.error)
        assert result.text == expected, case


def test_a_video_over_a_limit_or_damaged_is_a_400_naming_the_part_and_the_next_request_works(served):
    _, url, _ = served
    long_clip = video_bytes(clip_frames().repeat(2, axis=0), VIDEO_FPS)  # 4 s
    mp4 = video_bytes(clip_frames(), VIDEO_FPS, container="mp4", codec="mpeg4")
    for part, fragment in ((video_part(long_clip), "over the limit of 2 s"),
                           (video_part(mp4[:len(mp4) // 2], "video/mp4"), "unsupported or damaged video")):
        body = {"model": "omni_chat", "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]}
        response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages[0].content[1]" and fragment in error["message"], error
        assert "av." not in error["message"] and "Traceback" not in error["message"], error
    body = {"model": "omni_chat", "messages": messages("video"), "max_tokens": 2}
    assert requests.post(f"{url}/v1/chat/completions", json=body, timeout=300).status_code == 200
