"""`/v2/*`: Triton's HTTP (KServe v2) API passed through the front door's port, with two 2.51 defects fixed.

- `POST /v2/models/<m>/infer` on a decoupled model (or an ensemble holding one) answers 501 with a message that
  does not say what to do instead; here it is a 400 that names the ways that work (gRPC streaming,
  `generate_stream`, the OpenAI endpoints).
- `POST /v2/models/<m>/generate` answers an error with HTTP 200 when the model sends several responses (e.g.
  `"stream": true`), and a decoupled model's error with 400 whatever it was (2.51 passes only its message on):
  here a `{"error": ...}` body keeps Triton's shape but gets its status from the message, classified as the
  OpenAI endpoints do (`errors.stream_error`): the llm stage's "waiting queue is full ... retry later" 429, a stage
  that is unavailable, not admitting new requests or whose stub died ("Stub process ... is not healthy") 503,
  both with Retry-After; a fault ("llm failed: ...", "engine step failed") 500; the rest 400 (see
  `generate_error_status`).

Everything else (health, metadata, config, generate, generate_stream, infer on other models) is forwarded as is.
"""

from __future__ import annotations

import json
import re

import aiohttp
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from tritonclient.utils import InferenceServerException

from omni_backend.serving import errors

_MODEL_PATH = re.compile(r"^models/(?P<model>[^/]+)(/versions/[^/]+)?/(?P<action>infer|generate|generate_stream)$")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}


def generate_error_status(upstream_status: int, message: str) -> tuple[int, dict[str, str]]:
    """HTTP status and extra headers for an `{"error": message}` answer of Triton's `/generate`.

    Args:
        upstream_status: what Triton answered (200 when the model sent several responses, 400 for a decoupled
            model's error, or its own status for errors of its own such as an unknown model).
        message: the error body's message.

    Returns:
        429/503 with Retry-After for overload and an unavailable or dead stage, 500 for a fault, 400 for the
        rest of what Triton answered with 200 or 400; any other status of Triton's (404, ...) is kept.
    """
    error = errors.stream_error(message, "text_input")
    if error.status in (429, 503):
        return error.status, error.headers()
    if upstream_status in (200, 400):
        return (500 if error.status == 500 else 400), {}
    return upstream_status, {}


class V2Proxy:
    """Forwards `/v2/*` to Triton's HTTP port (see the module docstring)."""

    def __init__(self, config, door):
        self.config, self.door = config, door
        self._decoupled: dict[str, bool] = {}

    def router(self, check_key) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v2/health/{kind}", self.health, methods=["GET"])
        router.add_api_route("/v2/{path:path}", self.forward, methods=["GET", "POST"],
                             dependencies=[Depends(check_key)])
        return router

    async def health(self, kind: str, request: Request) -> Response:
        return await self.forward(f"health/{kind}", request)

    async def is_decoupled(self, model: str) -> bool:
        """True for a decoupled model or an ensemble with a decoupled step (what Triton's /infer refuses)."""
        if model not in self._decoupled:
            client = next(iter(self.door.pipelines.values())).client
            try:
                config = (await client.get_model_config(model, as_json=True))["config"]
            except InferenceServerException:
                return False  # unknown model: Triton's own answer says so
            decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled"))
            for step in config.get("ensemble_scheduling", {}).get("step", []):
                decoupled = decoupled or await self.is_decoupled(step["model_name"])
            self._decoupled[model] = decoupled
        return self._decoupled[model]

    async def forward(self, path: str, request: Request) -> Response:
        match = _MODEL_PATH.match(path)
        if request.method == "POST" and match and match["action"] == "infer" and await self.is_decoupled(match["model"]):
            model = match["model"]
            return JSONResponse(status_code=400, content={"error": (
                f"model '{model}' is decoupled (it answers with a stream of responses), which HTTP /infer cannot "
                f"carry: use gRPC streaming (ModelStreamInfer), POST /v2/models/{model}/generate_stream, "
                "or the OpenAI endpoints /v1/chat/completions and /v1/completions")})
        body = await request.body()
        if len(body) > self.config.max_body_bytes:
            return JSONResponse(status_code=413, content={
                "error": f"request body is larger than the limit of {self.config.max_body_bytes} bytes"})
        url = f"http://{self.config.triton_http}/v2/{path}"
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept",
                                                                              "inference-header-content-length")}
        try:
            upstream = await self.door.http().request(request.method, url, params=request.query_params,
                                                      data=body, headers=headers)
        except (aiohttp.ClientError, OSError) as exc:
            return JSONResponse(status_code=503, headers={"Retry-After": "1"},
                                content={"error": f"Triton HTTP endpoint unreachable: {type(exc).__name__}"})
        passed = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
        if match and match["action"] == "generate_stream":
            async def body_chunks():
                try:
                    async for chunk in upstream.content.iter_any():
                        yield chunk
                finally:
                    upstream.release()

            return StreamingResponse(body_chunks(), status_code=upstream.status, headers=passed)
        data = await upstream.read()
        upstream.release()
        status = upstream.status
        if match and match["action"] == "generate":
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and "error" in parsed:
                if "exactly 1 response" in str(parsed["error"]):
                    parsed["error"] = (f"{parsed['error']}: POST /v2/models/{match['model']}/generate_stream "
                                       "sends each response as a server-sent event")
                status, extra = generate_error_status(status, str(parsed["error"]))
                return JSONResponse(status_code=status, content=parsed, headers=extra)
        return Response(content=data, status_code=status, headers=passed)
