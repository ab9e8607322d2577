"""Plain HTTP helpers for front door tests (raw bodies, headers and statuses the openai client hides)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def post(url: str, body: bytes | str | dict | list | None, headers: dict | None = None, timeout: float = 120):
    """POST raw bytes (or JSON for a dict/list/None with a JSON content type); returns (status, headers, JSON)."""
    if isinstance(body, (dict, list)) or body is None:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(headers or {})}
    else:
        data = body.encode() if isinstance(body, str) else body
    request = urllib.request.Request(url, data=data, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, _lower(response.headers), json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = raw.decode(errors="replace")
        return exc.code, _lower(exc.headers), parsed


def get(url: str, headers: dict | None = None, timeout: float = 30):
    """GET; returns (status, headers, body text)."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, _lower(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, _lower(exc.headers), exc.read().decode()


def sse(url: str, body: dict, timeout: float = 120) -> tuple[int, list]:
    """POST a streamed request; returns (status, the `data:` payloads in order: parsed JSON, or "[DONE]")."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    events = []
    with urllib.request.urlopen(request, timeout=timeout) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for raw in response:
            line = raw.decode("utf-8").rstrip("\r\n")
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
        return response.status, events


def _lower(headers) -> dict:
    """Response headers with lower-case names."""
    return {name.lower(): value for name, value in headers.items()}
