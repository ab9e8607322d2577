"""Case c09 of shared/cases/README.md (empty speech input, empty voice, blank image prompt: 400 each with an
error object), each part followed by ordinary speech, image and chat requests that must succeed."""

import json

import pytest
from http_calls import MODEL, post

pytestmark = [pytest.mark.server, pytest.mark.reliability]


def ordinary_requests_work(url: str) -> None:
    status, headers, data = post(url + "/v1/audio/speech", {"model": MODEL, "input": "Hi there.", "voice": "alloy",
                                                            "response_format": "wav"})
    assert status == 200 and headers["content-type"] == "audio/wav" and len(data) > 1000, data[:200]
    status, _, data = post(url + "/v1/images/generations", {"model": MODEL, "prompt": "a cat", "size": "64x64",
                                                            "steps": 2})
    assert status == 200 and json.loads(data)["data"][0]["b64_json"], data[:200]
    status, _, data = post(url + "/v1/chat/completions", {"model": MODEL, "max_tokens": 3,
                                                          "messages": [{"role": "user", "content": "Say hi."}]})
    assert status == 200 and json.loads(data)["choices"][0]["message"]["content"], data[:200]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/audio/speech", {"model": MODEL, "input": "", "voice": "x"}, "input"),
    ("/v1/audio/speech", {"model": MODEL, "input": "hi", "voice": ""}, "voice"),
    ("/v1/images/generations", {"model": MODEL, "prompt": " "}, "prompt"),
])
def test_c09_empty_speech_and_image_inputs(front_door, path, body, param):
    status, headers, data = post(front_door.url + path, body)
    assert status == 400, data
    assert headers["content-type"].startswith("application/json")
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"
    ordinary_requests_work(front_door.url)


def test_c11_unknown_model_on_speech(front_door):
    status, _, data = post(front_door.url + "/v1/audio/speech",
                           {"model": "does-not-exist", "input": "hi", "voice": "alloy"})
    assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found"
