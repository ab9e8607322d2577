"""What every route shares: the served pipelines and the speech, voice and image backends, admission (the limit on
requests in flight), metrics, the HTTP session to Triton, and the API key and operator key checks."""

from __future__ import annotations

import asyncio
import hmac
from contextlib import asynccontextmanager

import aiohttp
from fastapi import Request

from omni_backend.operator_key import ADMIN_KEY_HEADER
from omni_backend.serving import errors, image_backend, speech_backend
from omni_backend.serving.config import ServingConfig
from omni_backend.serving.errors import OpenAIError
from omni_backend.serving.image_backend import ImageBackend
from omni_backend.serving.metrics import FrontDoorMetrics, StageWatch
from omni_backend.serving.pipeline import TritonPipeline
from omni_backend.serving.speech_backend import SpeechBackend
from omni_backend.serving.voice_backend import VoiceBackend


class FrontDoor:
    """State shared by the routes (`door_of(request)` finds it).

    Args:
        config: the front door's settings.
    """

    def __init__(self, config: ServingConfig):
        self.config = config
        self.session: aiohttp.ClientSession | None = None
        self.watch = StageWatch(self.http, config.triton_metrics_url)  # stages whose stub died (heartbeats)
        self.pipelines = {name: TritonPipeline(config.triton_grpc, name, self.watch) for name in config.models}
        self.speech = SpeechBackend(config.stage_grpc(speech_backend.STAGE))
        self.voice = VoiceBackend(config.triton_grpc)  # the served model's own voice, when it has a talker
        self.images = ImageBackend(config.stage_grpc(image_backend.STAGE))
        # the stages on servers of their own, with the model whose readiness stands for each (`stage_problems`)
        backends = {speech_backend.STAGE: (self.speech, speech_backend.TTS_MODEL),
                    image_backend.STAGE: (self.images, image_backend.ENSEMBLE)}
        self.separate = {stage: backends[stage] for stage in config.stage_endpoints}
        self.metrics = FrontDoorMetrics()
        self.in_flight = 0
        self.model_configs: dict[str, dict] = {}  # Triton model configs read for /v2 (routes/triton_v2.py)

    async def close(self) -> None:
        for backend in (*self.pipelines.values(), self.speech, self.voice, self.images):
            await backend.close()
        if self.session is not None:
            await self.session.close()

    async def stage_problems(self) -> dict[str, str]:
        """stage -> why it cannot serve now, for each stage on a server of its own (`stage_endpoints`) that cannot;
        each server is asked for at most READY_TIMEOUT_S (serving/triton_client.py), all at once."""
        problems = await asyncio.gather(*(backend.model_problem(model) for backend, model in self.separate.values()))
        return {stage: problem for stage, problem in zip(self.separate, problems, strict=True) if problem is not None}

    def http(self) -> aiohttp.ClientSession:
        """The aiohttp session for Triton's HTTP and metrics ports (made on first use, in the serving loop)."""
        if self.session is None:
            self.session = aiohttp.ClientSession()
        return self.session

    def pipeline_for(self, body: dict) -> TritonPipeline | None:
        """The served model a request names; None when `model` is missing or not a string (the schema check
        names the field).

        Raises:
            OpenAIError: 404 model_not_found for an unknown model.
        """
        model = body.get("model")
        if not isinstance(model, str):
            return None
        if model not in self.pipelines:
            raise errors.model_not_found(model)
        return self.pipelines[model]

    def check_model(self, body: dict, own_names: tuple[str, ...]) -> None:
        """Check the model asked of an endpoint with its own model names (speech, images).

        Raises:
            OpenAIError: 400 when `model` is missing or not a string; 404 model_not_found when it is neither one
                of `own_names` nor a served pipeline (the same answer as on every other endpoint).
        """
        model = body.get("model")
        if not isinstance(model, str):
            raise errors.invalid("'model' is a required property", "model")
        if model not in own_names:
            self.pipeline_for(body)

    @asynccontextmanager
    async def admitted(self):
        """Hold one of `max_concurrent_requests` slots (429 with Retry-After when none is free)."""
        limit = self.config.max_concurrent_requests
        if limit and self.in_flight >= limit:
            raise errors.overloaded(limit)
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            yield
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()


def door_of(request: Request) -> FrontDoor:
    """The FrontDoor of the app serving `request`."""
    return request.app.state.door


async def require_api_key(request: Request) -> None:
    """A route dependency: with an API key configured, `Authorization: Bearer <key>` is required.

    Raises:
        OpenAIError: 401 authentication_error without the right key.
    """
    key = door_of(request).config.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or token.strip() != key:
        raise OpenAIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                          "authentication_error", None, "invalid_api_key")


def is_operator(request: Request) -> bool:
    """The request carries the operator's key in the `omni-admin-key` header (none configured: nobody is the
    operator here)."""
    key = door_of(request).config.admin_key
    given = request.headers.get(ADMIN_KEY_HEADER)
    return bool(key) and given is not None and hmac.compare_digest(given.encode(), key.encode())


async def require_operator_key(request: Request) -> None:
    """A route dependency for the operator's routes: the operator's key in the `omni-admin-key` header.

    Raises:
        OpenAIError: 403 without it (the status of the other restricted routes, `/v2` beyond inference).
    """
    if not is_operator(request):
        raise OpenAIError(403, f"{request.method} {request.url.path} needs the operator's key in the "
                          f"'{ADMIN_KEY_HEADER}' header", "permission_error", None, "permission_denied")
