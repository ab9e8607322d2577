"""Plain HTTP calls for the speech and image tests (status, headers and body bytes, errors included), and Triton's
per-model statistics."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

MODEL = "omni_chat"
"""The served chat model (the front door's default)."""


def post(url: str, body: dict, timeout: float = 180) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def post_json(url: str, body: dict, timeout: float = 180) -> tuple[int, dict]:
    status, _, data = post(url, body, timeout)
    return status, json.loads(data)


def sse_timed(url: str, body: dict, timeout: float = 180) -> list[tuple[float, object]]:
    """A streamed request: every `data:` payload (parsed JSON or "[DONE]") with its arrival time in seconds
    after the request was sent."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    started = time.monotonic()
    events = []
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for raw in response:
            line = raw.decode("utf-8").rstrip("\r\n")
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append((time.monotonic() - started, data if data == "[DONE]" else json.loads(data)))
    return events


def model_stats(http_url: str, model: str) -> dict:
    """Triton's statistics of one model (version 1): inference_count, execution_count, ..."""
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/stats", timeout=30) as response:
        return json.loads(response.read())["model_stats"][0]
