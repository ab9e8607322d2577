"""The OpenAI-compatible HTTP front door as one FastAPI app: the routes of serving/routes/, error handlers, CORS
and request metrics.

Request checks run in the order a client can act on: API key (401), content type and coding (415), body size
(413, after decompression), JSON (400), model (404, the same on every endpoint), fields (400 naming the field),
admission (429), then Triton (the error kind the stage reported: 400, 429/503 + Retry-After, 500). Streamed
answers are server-sent events whose chunks follow OpenAI's ChatCompletionChunk / Completion schemas.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from omni_backend.serving import errors, openapi
from omni_backend.serving.config import ServingConfig
from omni_backend.serving.errors import OpenAIError
from omni_backend.serving.front_door import FrontDoor
from omni_backend.serving.metrics import ObserveRequests
from omni_backend.serving.routes import admin, chat, images, operations, speech, triton_v2

logger = logging.getLogger("omni_backend.serving")


def create_app(config: ServingConfig) -> FastAPI:
    """The FastAPI application for `config` (run it with uvicorn; see `omni_backend.serving.__main__`)."""
    door = FrontDoor(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await door.close()

    # FastAPI's own /openapi.json and /docs are off: serving/openapi.py serves the document with the pipeline's limits
    app = FastAPI(title=openapi.TITLE, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.door = door
    install_error_handlers(app)
    for module in (operations, chat, speech, images, admin):
        app.include_router(module.router)
    app.include_router(operations.models_router)
    app.include_router(triton_v2.router)
    app.include_router(triton_v2.api)
    if config.docs:
        app.include_router(openapi.router)
    app.add_middleware(ObserveRequests, metrics=door.metrics)
    # CORS: off unless origins are allowed (a browser's preflight from any other origin gets 400, never 405).
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_methods=["GET", "HEAD", "POST", "OPTIONS"], allow_headers=["*"],
                       expose_headers=["Retry-After", "X-Sample-Rate"])
    return app


def install_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI error object; 499 (nobody to answer) for a client that left mid-body."""

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect):
        return Response(status_code=499)  # seen in the cancel storm; no fault to log

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        error = errors.invalid(f"invalid request: {exc.errors()[0].get('msg')}", None)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = OpenAIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                            "invalid_request_error", None, code)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def fault(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        error = errors.internal(f"internal server error ({type(exc).__name__})")
        return JSONResponse(error.body(), status_code=500)
