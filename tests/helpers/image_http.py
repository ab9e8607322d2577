"""HTTP and Triton-statistics helpers for the image tests."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

MODEL = "omni_chat"
"""The served chat model (the front door's default); /v1/images/generations also answers to it."""


def post_json(url: str, body: dict, timeout: float = 300) -> tuple[int, dict, dict]:
    """POST JSON; returns (status, lower-case headers, parsed body)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, json.loads(exc.read())


def model_stats(http_url: str, model: str) -> dict:
    """Triton's statistics of one model (version 1): inference_count, execution_count, ..."""
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/stats", timeout=30) as response:
        return json.loads(response.read())["model_stats"][0]
