"""Front door operations: API key, body limit, overload (429/503 + Retry-After), health, metrics. (The
cancellation of a Triton request when its HTTP client disconnects is case c18 in tests/reliability/test_cases.py.)"""

import asyncio
import json
import time

import aiohttp
import pytest
from helpers.front_door import MODEL
from helpers.frontdoor_http import get, post

from omni_backend.launch.ports import free_ports

pytestmark = [pytest.mark.server, pytest.mark.reliability]

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}


def test_api_key_is_required_when_configured_but_health_stays_open(make_front_door):
    door = make_front_door(api_key="sekret")
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": MODEL, "prompt": "hi"})):
        status, _, answer = post(door.url + path, body)
        assert status == 401 and answer["error"]["type"] == "authentication_error"
        status, _, answer = post(door.url + path, body, headers={"Authorization": "Bearer wrong"})
        assert status == 401
    assert get(door.url + "/v1/models")[0] == 401
    assert get(door.url + "/health")[0] == 200
    status, _, answer = post(door.url + "/v1/chat/completions", CHAT, headers={"Authorization": "Bearer sekret"})
    assert status == 200, answer
    import openai

    client = openai.OpenAI(base_url=door.url + "/v1", api_key="sekret", max_retries=0)
    assert client.chat.completions.create(**CHAT).choices[0].message.content


def test_body_limit_is_413(make_front_door):
    door = make_front_door(max_body_bytes=4096)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    status, _, answer = post(door.url + "/v1/chat/completions", big)
    assert status == 413 and "4096" in answer["error"]["message"]
    assert post(door.url + "/v1/chat/completions", CHAT)[0] == 200


def test_requests_over_the_limit_get_429_with_retry_after(make_front_door):
    door = make_front_door(max_concurrent_requests=1)

    async def run():
        async with aiohttp.ClientSession() as session:
            held = await session.post(door.url + "/v1/completions", json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True})
            await held.content.readline()  # the first chunk: the request is in the engine
            async with session.post(door.url + "/v1/chat/completions", json=CHAT) as refused:
                result = refused.status, refused.headers.get("retry-after"), await refused.json()
            held.close()
            return result

    status, retry_after, answer = asyncio.run(run())
    assert status == 429 and retry_after == "1" and answer["error"]["code"] == "rate_limit_exceeded"
    deadline = time.monotonic() + 10
    while post(door.url + "/v1/chat/completions", CHAT)[0] != 200:  # the slot comes back once the stream ends
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_triton_unavailable_is_503_with_retry_after(make_front_door):
    (dead,) = free_ports(1)
    door = make_front_door(triton_grpc=f"localhost:{dead}", triton_http=f"localhost:{dead}",
                           triton_metrics_url=f"http://localhost:{dead}/metrics")
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": MODEL, "prompt": "hi"})):
        status, headers, answer = post(door.url + path, body)
        assert status == 503 and headers.get("retry-after") == "1", answer
        assert answer["error"]["type"] == "server_error"
    status, headers, _ = get(door.url + "/health")
    assert status == 503 and headers.get("retry-after") == "1"
    status, _, text = get(door.url + "/metrics")
    assert status == 200 and "Triton metrics unavailable" in text and "omni_frontdoor_requests_total" in text


def test_health_models_and_unknown_routes(front_door):
    assert get(front_door.url + "/health")[0] == 200
    status, _, text = get(front_door.url + "/v1/nothing-here")
    assert status == 404 and json.loads(text)["error"]["type"] == "invalid_request_error"
    status, _, text = get(front_door.url + "/v1/chat/completions")
    assert status == 405 and "error" in json.loads(text)


def test_metrics_hold_triton_and_front_door_series(front_door):
    post(front_door.url + "/v1/chat/completions", {**CHAT, "temperature": 9})
    post(front_door.url + "/v1/chat/completions", CHAT)
    status, headers, text = get(front_door.url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert 'nv_inference_request_success{model="llm"' in text  # Triton's own
    assert 'omni_frontdoor_requests_total{endpoint="/v1/chat/completions",status="400"}' in text
    assert 'omni_frontdoor_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert 'omni_frontdoor_request_duration_seconds_bucket{endpoint="/v1/chat/completions",le="0.5"}' in text
    assert "omni_frontdoor_time_to_first_token_seconds_count" in text
