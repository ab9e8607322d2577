"""`GET /health`, `GET /metrics` (no API key needed) and `GET /v1/models[/<model>]`; each also answers HEAD (the
same status and headers, no body)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from omni_backend.ops.metrics import stages_ready
from omni_backend.serving import errors
from omni_backend.serving.front_door import FrontDoor, door_of, require_api_key
from omni_backend.serving.metrics import triton_metrics
from omni_backend.serving.schemas import Health, ModelCard, ModelList, answers

GET = ["GET", "HEAD"]

router = APIRouter()
models_router = APIRouter(dependencies=[Depends(require_api_key)])


@router.api_route("/health", methods=GET, operation_id="health", summary="Readiness",
                  responses=answers({"model": Health}, (503,)))
async def health(request: Request):
    """200 when Triton and the models are ready, no unary stage was found dead and every stage's heartbeat is
    fresh; else 503 naming why. A stage on a server of its own (`stage_endpoints`) that cannot serve makes it 200
    "degraded" naming the stage: the served models still answer (a probe taking this front door out of service
    would stop chat too), only the requests needing that stage get 503."""
    door = door_of(request)
    down = {stage: message for p in door.pipelines.values() for stage, message in p.down_stages.items()}
    if down:  # a unary stage's stub died (Triton keeps it READY and restarts no stub): pipeline.down_stages
        raise errors.unavailable("stage process dead: " + "; ".join(f"{s}: {m}" for s, m in sorted(down.items())))
    ready = all([await p.ready() for p in door.pipelines.values()])
    if not ready:
        raise errors.unavailable("Triton or a served model is not ready")
    # Triton 2.51 cannot mark itself unready from a Python model, and keeps a model READY after its stub
    # process died: a stage's governor refusing new requests (critical GPU temperature) and a stage whose
    # heartbeat stopped show on the metrics port (omni_backend/ops/metrics.py stages_ready).
    ready, reason = stages_ready(await triton_metrics(door.http(), door.config.triton_metrics_url))
    if not ready:
        raise errors.unavailable(reason)
    down = await door.stage_problems()
    return {"status": "degraded", "stages_down": down} if down else {"status": "ok"}


@router.api_route("/metrics", methods=GET, operation_id="metrics", summary="Prometheus metrics",
                  response_class=PlainTextResponse, responses=answers(errors=(500,)))
async def metrics(request: Request):
    """Triton's Prometheus metrics followed by the front door's own."""
    door = door_of(request)
    triton = await triton_metrics(door.http(), door.config.triton_metrics_url)
    body = triton.rstrip("\n") + "\n" + door.metrics.text().decode()
    return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")


async def model_card(door: FrontDoor, name: str) -> dict:
    info = await door.pipelines[name].info()
    return {"id": name, "object": "model", "created": info.created, "owned_by": "omni_backend",
            "root": name, "parent": None, "max_model_len": info.max_model_len}


@models_router.api_route("/v1/models", methods=GET, operation_id="listModels", summary="Served models",
                         responses=answers({"model": ModelList}, (401, 500, 503)))
async def list_models(request: Request):
    """The served models, with `max_model_len` (read from the llm model's config in Triton)."""
    door = door_of(request)
    return {"object": "list", "data": [await model_card(door, name) for name in door.pipelines]}


@models_router.api_route("/v1/models/{model:path}", methods=GET, operation_id="retrieveModel", summary="One model",
                         responses=answers({"model": ModelCard}, (401, 404, 500, 503)))
async def get_model(request: Request, model: str):
    door = door_of(request)
    if model not in door.pipelines:
        raise errors.model_not_found(model)
    return await model_card(door, model)
