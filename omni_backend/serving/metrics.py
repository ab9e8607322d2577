"""Prometheus metrics of the front door, served on `/metrics` after Triton's own (fetched from its metrics port)."""

from __future__ import annotations

import time

import asyncio

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from omni_backend.ops.metrics import stale_stages

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Routes whose requests are counted under their own name; anything else is "other" (bounded label values).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
             "/v1/images/generations", "/v1/audio/speech", "/v1/audio/transcriptions", "/v1/embeddings")


class FrontDoorMetrics:
    """The front door's request counters and latency histograms, in a registry of their own."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("omni_frontdoor_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("omni_frontdoor_request_duration_seconds",
                                 "Time from request to the end of the response body, by endpoint",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("omni_frontdoor_time_to_first_token_seconds",
                              "Time from request to the first generated text (all choices started)",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("omni_frontdoor_generations_in_flight", "Generation requests being served",
                               registry=self.registry)
        self.prompt_tokens = Counter("omni_frontdoor_prompt_tokens", "Prompt tokens of answered requests",
                                     registry=self.registry)
        self.completion_tokens = Counter("omni_frontdoor_completion_tokens",
                                         "Completion tokens of answered requests", registry=self.registry)

    @staticmethod
    def endpoint(path: str) -> str:
        if path.startswith("/v2/"):
            return "/v2"
        if path.startswith("/v1/models"):
            return "/v1/models"
        return path if path in ENDPOINTS else "other"

    def observe(self, path: str, status: int, started: float) -> None:
        endpoint = self.endpoint(path)
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(time.monotonic() - started)

    def text(self) -> bytes:
        return generate_latest(self.registry)


async def triton_metrics(session: aiohttp.ClientSession, url: str) -> str:
    """Triton's Prometheus text from its metrics port, or a comment saying why it is missing."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as response:
            if response.status != 200:
                return f"# Triton metrics unavailable: HTTP {response.status} from {url}\n"
            return await response.text()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return f"# Triton metrics unavailable: {type(exc).__name__} from {url}\n"


class StageWatch:
    """Which Triton stages have stopped responding (stub process dead or hung), from the heartbeat gauge each
    stage publishes on Triton's metrics page (omni_backend/ops/metrics.py `stale_stages`).

    Triton 2.51 keeps a dead Python stub's model READY and never ends the streams it was serving, so the front
    door asks this while it waits on a stream. One scrape serves every caller for `cache_s` seconds.

    Args:
        session: returns the aiohttp session to scrape with.
        url: Triton's metrics URL.
        cache_s: how long one scrape's answer is reused.
    """

    def __init__(self, session, url: str, cache_s: float = 0.5):
        self.session, self.url, self.cache_s = session, url, cache_s
        self._checked = float("-inf")  # time.monotonic() of the last scrape
        self._silent: dict[tuple[str, str], float] = {}
        self._lock = asyncio.Lock()

    async def silent(self, model: str) -> float | None:
        """Seconds since `model` last published its heartbeat when that is too long ago, else None (also when
        the metrics page cannot be read: no evidence is not evidence of death)."""
        async with self._lock:
            if time.monotonic() - self._checked >= self.cache_s:
                self._silent = stale_stages(await triton_metrics(self.session(), self.url))
                self._checked = time.monotonic()
        ages = [age for (name, _), age in self._silent.items() if name == model]
        return max(ages) if ages else None


class ObserveRequests:
    """ASGI middleware: count every HTTP request by endpoint and status and time it to its last body byte.

    Pure ASGI (not BaseHTTPMiddleware), so streamed responses and client disconnects pass through untouched.
    """

    def __init__(self, app, metrics: FrontDoorMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        status = {"code": 499}  # stays 499 (client closed) if no response was started

        async def observed_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        except Exception:
            if status["code"] == 499:
                status["code"] = 500
            raise
        finally:
            self.metrics.observe(scope["path"], status["code"], started)
