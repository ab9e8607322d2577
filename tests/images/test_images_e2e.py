"""Image generation through the real stack: same seed -> the same PNG bytes; concurrent compatible requests
are batched by the diffusion stage (Triton statistics). Case c10 is in tests/reliability/test_cases.py."""

import base64
import io
import json
import threading

import numpy as np
import pytest
from helpers.http_calls import MODEL, model_stats, post

pytestmark = pytest.mark.server


def post_and_parse(url: str, body: dict) -> tuple[int, dict, dict]:
    """POST JSON; (status, headers, parsed body)."""
    status, headers, data = post(url, body)
    return status, {k.lower(): v for k, v in headers.items()}, json.loads(data)


SMALL = {"model": MODEL, "size": "64x64", "steps": 3}


def png_of(body: dict) -> bytes:
    return base64.b64decode(body["data"][0]["b64_json"])


def test_same_seed_gives_byte_identical_images(front_door):
    from PIL import Image

    request = dict(SMALL, prompt="a red bicycle", seed=1234)
    status, _, first = post_and_parse(front_door.url + "/v1/images/generations", request)
    assert status == 200, first
    status, _, second = post_and_parse(front_door.url + "/v1/images/generations", request)
    assert status == 200 and png_of(first) == png_of(second)
    assert first["data"][0]["seed"] == 1234
    image = Image.open(io.BytesIO(png_of(first)))
    assert image.format == "PNG" and image.size == (64, 64) and image.mode == "RGB"
    status, _, other = post_and_parse(front_door.url + "/v1/images/generations", dict(request, seed=1235))
    assert status == 200 and png_of(other) != png_of(first)
    status, _, pair = post_and_parse(front_door.url + "/v1/images/generations", dict(request, n=2))
    assert status == 200 and [d["seed"] for d in pair["data"]] == [1234, 1235]
    assert png_of(pair) == png_of(first) or np.abs(  # batched: equal up to last-bit float differences
        np.asarray(Image.open(io.BytesIO(png_of(pair))), dtype=int) - np.asarray(image, dtype=int)).max() <= 1


def test_concurrent_compatible_requests_are_batched(front_door, triton_server, record_property):
    before = model_stats(triton_server.http_url, "diffusion")
    results = [None] * 4
    barrier = threading.Barrier(4)

    def one(i):
        barrier.wait()
        results[i] = post_and_parse(front_door.url + "/v1/images/generations",
                               dict(SMALL, prompt=f"a red bicycle number {i}", seed=i))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert all(r is not None and r[0] == 200 for r in results), results
    after = model_stats(triton_server.http_url, "diffusion")
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    record_property("diffusion_inferences", inferences)
    record_property("diffusion_executions", executions)
    print(f"4 concurrent requests: {inferences} inferences in {executions} diffusion executions")
    assert inferences == 4 and executions < 4


def test_bad_values_are_400_naming_the_field(front_door):
    for extra, param in [({"steps": 0}, "steps"), ({"steps": 51}, "steps"), ({"guidance_scale": 99}, "guidance_scale"),
                         ({"n": 11}, "n"), ({"response_format": "url"}, "response_format"), ({"size": "big"}, "size")]:
        status, _, body = post_and_parse(front_door.url + "/v1/images/generations", dict(SMALL, prompt="x", **extra))
        assert status == 400 and body["error"]["param"] == param, (extra, body)
    status, _, body = post_and_parse(front_door.url + "/v1/images/generations",
                                     {"model": "does-not-exist", "prompt": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
