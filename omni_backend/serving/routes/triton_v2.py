"""`/v2/*`: Triton's HTTP (KServe v2) API through the front door's port: an allow-list, typed bodies, clear errors.

Open to every client (with the API key when one is set; health needs none): health (`/v2/health/live|ready`),
server and model metadata, model config and readiness, and inference (`infer`, `generate`, `generate_stream`).
Everything else (the model repository, logging, trace, shared memory, statistics) needs the operator's key in
the `omni-admin-key` header, the key tritonserver itself requires for those APIs (`--http-restricted-api`,
see omni_backend/launch/tritonserver.py); without it the answer is 403.

Fixed on the way through (Triton 2.51 defects):
- `POST /v2/models/<m>/generate[_stream]` bodies are checked against the model's input types before Triton
  parses them: Triton's JSON parser casts an INT32 value of 4294967304 to 8 and serves it, and answers a string
  where a number belongs with 500 "Unable to parse 'data'". Here every input gets its datatype's range
  (`vocabulary.tensor_value_problem`), and a generation setting also SamplingParams' range
  (`vocabulary.SAMPLING_FIELDS`): a 400 naming the input and what it takes. An input of fixed dims must hold
  that many values (`[[]]` for a one-value input is Triton's 500 "Shape does not match true shape").
- `POST /v2/models/<m>/infer` on a decoupled model (or an ensemble holding one) answers 501 with a message that
  does not say what to do instead; here it is a 400 that names the ways that work.
- `POST /v2/models/<m>/generate` answers an error with HTTP 200 when the model sends several responses (e.g.
  `"stream": true`), and a decoupled model's error with 400 whatever it was (2.51 passes only its message on):
  here the `{"error": ...}` body keeps Triton's shape and gets the status of the error's kind
  (`errors.from_triton`: 400, 429/503 with Retry-After, 500).
Bodies may be gzip/deflate-compressed (`Content-Encoding`); they are forwarded decoded.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated

import aiohttp
from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from tritonclient.utils import InferenceServerException

from omni_backend import tensor_names as T
from omni_backend.operator_key import ADMIN_KEY_HEADER
from omni_backend.serving import errors
from omni_backend.serving.errors import OpenAIError
from omni_backend.serving.front_door import FrontDoor, door_of, is_operator, require_api_key
from omni_backend.serving.request_body import parse_json_object, read_body
from omni_backend.serving.schemas import (ERROR_MEANINGS, ErrorResponse, InferRequest, TritonAnswer, TritonError, answers,
                                          json_body)
from omni_backend.vocabulary import BY_TENSOR, DATATYPE_RANGES, StageError, tensor_value_problem

_MODEL = r"models/(?P<model>[^/]+)(?:/versions/[^/]+)?"
_OPEN = {  # method -> paths (relative to /v2/) any client may use
    "GET": re.compile(rf"^(|health/(live|ready)|{_MODEL}(/config|/ready)?)$"),
    "POST": re.compile(rf"^{_MODEL}/(?P<action>infer|generate|generate_stream)$"),
}
_FORWARDED_HEADERS = ("content-type", "accept", "inference-header-content-length", ADMIN_KEY_HEADER)
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}

GET = ["GET", "HEAD"]
GENERATE_BODY = "GenerateRequest"  # its schema is the served entry point's inputs (`generate_schema`)
TRITON_ERRORS = (400, 403, 404, 405, 413, 415, 500, 503)
ANSWER = {"model": TritonAnswer, "description": "Triton's answer."}
TRITON_ERROR_REF = {"$ref": "#/components/schemas/TritonError"}
PLAIN_ERROR = {"text/plain": {"schema": TRITON_ERROR_REF}}  # Triton labels some of its JSON errors text/plain
TRITON_ANSWERS = answers(ANSWER, TRITON_ERRORS, TritonError, PLAIN_ERROR,
                         r401={"model": ErrorResponse, "description": ERROR_MEANINGS[401]})
EMPTY_ANSWER = {"description": "Yes (an empty body; no is a 400, or 503 while Triton is unreachable).",
                "content": {"text/plain": {"schema": {"type": "string", "maxLength": 0}}}}
EVENTS = {"text/event-stream": {"schema": {"type": "object", "description": "One `data: {...}` event per response "
                                           "(an `{\"error\": ...}` one if the model fails)."}}}

router = APIRouter()
api = APIRouter(dependencies=[Depends(require_api_key)])  # the named operations beyond health
Model = Annotated[str, Path(description="A model of Triton's repository (the chat entry point: omni_chat).",
                            examples=["omni_chat"])]


def _triton_error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    """An error in Triton's own shape, `{"error": message}`."""
    return JSONResponse(status_code=status, content={"error": message}, headers=headers)


@router.api_route("/v2/health/{kind}", methods=GET, operation_id="tritonHealth", summary="Triton live / ready",
                  responses=answers(EMPTY_ANSWER, (400, 403, 503), TritonError, PLAIN_ERROR))
async def health(kind: Annotated[str, Path(json_schema_extra={"enum": ["live", "ready"]})],
                 request: Request) -> Response:
    return await forward(f"health/{kind}", request)


@api.api_route("/v2", methods=GET, operation_id="tritonServerMetadata", summary="Triton server metadata",
               responses=TRITON_ANSWERS)
async def server_metadata(request: Request) -> Response:
    return await forward("", request)


@api.api_route("/v2/models/{model}", methods=GET, operation_id="tritonModelMetadata", summary="Model metadata",
               responses=TRITON_ANSWERS)
async def model_metadata(model: Model, request: Request) -> Response:
    return await forward(f"models/{model}", request)


@api.api_route("/v2/models/{model}/config", methods=GET, operation_id="tritonModelConfig", summary="Model config",
               responses=TRITON_ANSWERS)
async def model_config_route(model: Model, request: Request) -> Response:
    return await forward(f"models/{model}/config", request)


@api.api_route("/v2/models/{model}/ready", methods=GET, operation_id="tritonModelReady", summary="Model ready",
               responses={**TRITON_ANSWERS, 200: EMPTY_ANSWER})
async def model_ready(model: Model, request: Request) -> Response:
    return await forward(f"models/{model}/ready", request)


@api.post("/v2/models/{model}/infer", operation_id="tritonInfer", summary="KServe v2 inference",
          openapi_extra=json_body(InferRequest), responses=TRITON_ANSWERS)
async def model_infer(model: Model, request: Request) -> Response:
    """Unary models only: a decoupled one (the chat entry points) is a 400 naming the ways that work."""
    return await forward(f"models/{model}/infer", request)


@api.post("/v2/models/{model}/generate", operation_id="tritonGenerate", summary="Triton generate (one response)",
          openapi_extra=json_body(GENERATE_BODY, "Input tensors by name (a value, or a list of values)."),
          responses=TRITON_ANSWERS)
async def model_generate(model: Model, request: Request) -> Response:
    """The model's inputs by name; the schema is the served chat entry point's. Checked against the model's input
    types and the generation settings' ranges before Triton reads them."""
    return await forward(f"models/{model}/generate", request)


@api.post("/v2/models/{model}/generate_stream", operation_id="tritonGenerateStream",
          summary="Triton generate (server-sent events)", openapi_extra=json_body(GENERATE_BODY),
          response_class=Response, responses={
              **TRITON_ANSWERS, 200: {"description": "The responses as server-sent events.", "content": EVENTS},
              400: {"description": ERROR_MEANINGS[400], "content": {"application/json": {"schema": {
                  "$ref": "#/components/schemas/TritonError"}}, **EVENTS}}})
async def model_generate_stream(model: Model, request: Request) -> Response:
    return await forward(f"models/{model}/generate_stream", request)


@api.api_route("/v2/{path:path}", methods=["GET", "HEAD", "POST"], operation_id="tritonOperatorApi",
               summary="Triton's other APIs (operator)", responses={**TRITON_ANSWERS, 404: {
                   "description": "No such model or API: Triton's error, or an OpenAI error for a path no route of "
                                  "the front door takes (a control character in it).",
                   "content": {"application/json": {"schema": {"anyOf": [
                       TRITON_ERROR_REF, {"$ref": "#/components/schemas/ErrorResponse"}]}}, **PLAIN_ERROR}}})
async def forward(path: str, request: Request) -> Response:
    """Versioned model paths, and the APIs beyond inference, metadata and health (the model repository, logging,
    trace, shared memory, statistics), which need the operator's key in the `omni-admin-key` header."""
    door = door_of(request)
    method = "GET" if request.method == "HEAD" else request.method
    match = _OPEN.get(method, re.compile("$^")).match(path)
    if match is None and not is_operator(request):
        return _triton_error(403, f"{request.method} /v2/{path} is not open on this port: inference, generate, "
                             f"model metadata/config, health and ready are; the rest needs the operator's key in "
                             f"the '{ADMIN_KEY_HEADER}' header")
    action = match["action"] if match is not None and method == "POST" else None
    if action == "infer" and await _is_decoupled(door, match["model"]):
        model = match["model"]
        return _triton_error(400, f"model '{model}' is decoupled (it answers with a stream of responses), which "
                             f"HTTP /infer cannot carry: use gRPC streaming (ModelStreamInfer), POST "
                             f"/v2/models/{model}/generate_stream, or the OpenAI endpoints /v1/chat/completions "
                             "and /v1/completions")
    try:
        body = await read_body(request, door.config.max_body_bytes)
        if action in ("generate", "generate_stream"):
            await _check_generate_body(door, match["model"], body)
    except OpenAIError as exc:
        return _triton_error(exc.status, exc.message)
    headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
    url = f"http://{door.config.triton_http}/v2" + (f"/{path}" if path else "")  # Triton's "/v2/" is a 404
    try:
        upstream = await door.http().request(method, url, params=request.query_params, data=body, headers=headers)
    except (aiohttp.ClientError, OSError) as exc:
        return _triton_error(503, f"Triton HTTP endpoint unreachable: {type(exc).__name__}", {"Retry-After": "1"})
    passed = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
    if action == "generate_stream" and request.method != "HEAD":
        async def body_chunks():
            try:
                async for chunk in upstream.content.iter_any():
                    yield chunk
            finally:
                upstream.release()

        return StreamingResponse(body_chunks(), status_code=upstream.status, headers=passed)
    data = await upstream.read()
    upstream.release()
    if action == "generate":
        error = _generate_error(upstream.status, data, match["model"])
        if error is not None:
            return error
    return Response(content=b"" if request.method == "HEAD" else data, status_code=upstream.status, headers=passed)


async def model_config(door: FrontDoor, model: str) -> dict | None:
    """The model's config from Triton (kept once read), None for a model Triton does not know."""
    if model not in door.model_configs:
        client = next(iter(door.pipelines.values())).client
        try:
            door.model_configs[model] = (await client.get_model_config(model, as_json=True))["config"]
        except InferenceServerException:
            return None
    return door.model_configs[model]


async def _is_decoupled(door: FrontDoor, model: str) -> bool:
    """True for a decoupled model or an ensemble with a decoupled step (what Triton's /infer refuses)."""
    config = await model_config(door, model)
    if config is None:
        return False  # unknown model: Triton's own answer says so
    if config.get("model_transaction_policy", {}).get("decoupled"):
        return True
    for step in config.get("ensemble_scheduling", {}).get("step", []):
        if await _is_decoupled(door, step["model_name"]):
            return True
    return False


async def _check_generate_body(door: FrontDoor, model: str, body: bytes) -> None:
    """Check a `/generate` body's inputs against the model's input types (see the module docstring).

    Raises:
        OpenAIError: 400 naming the first required input missing or the first input whose value its type (or
            its setting's range) does not take, or for a body that is not a JSON object.
    """
    values = parse_json_object(body)
    for key in values:  # Triton reads the other keys as request parameters, by C string: "a\0b" is never found
        if "\0" in key:
            raise errors.invalid(f"{key!r}: a key with a NUL character (Triton cannot read it)", key)
    config = await model_config(door, model)
    if config is None:
        return  # Triton answers an unknown model itself
    for spec in config.get("input", []):
        name = spec["name"]
        if name not in values:
            if not spec.get("optional"):  # a 400 of ours rather than Triton's own wording
                raise errors.invalid(f"{name} is required (an input of model '{model}')", name)
            continue
        datatype = spec["data_type"].removeprefix("TYPE_").replace("STRING", "BYTES")
        setting = BY_TENSOR.get(name)
        elements = _elements(values[name])
        dims = [int(d) for d in spec.get("dims", [])]
        if all(d >= 0 for d in dims) and len(elements) != math.prod(dims):  # Triton: 500 "Shape does not match"
            raise errors.invalid(f"{name} takes {math.prod(dims)} value(s), got {len(elements)}", name)
        for value in elements:
            problem = setting.problem(value) if setting is not None else tensor_value_problem(datatype, value)
            if problem is not None:
                raise errors.invalid(f"{name} {problem}", name)


def _elements(value) -> list:
    """The scalars of a JSON value given for a tensor (a scalar, or nested lists of them)."""
    if isinstance(value, list):
        return [item for inner in value for item in _elements(inner)]
    return [value]


def _generate_error(upstream_status: int, data: bytes, model: str) -> JSONResponse | None:
    """The answer for an `{"error": ...}` body of Triton's `/generate` (see the module docstring), None for a
    body without one."""
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or "error" not in parsed:
        return None
    message = str(parsed["error"])
    if "exactly 1 response" in message:  # the model sent several responses (a stream) to /generate
        return _triton_error(400, f"{message}: POST /v2/models/{model}/generate_stream sends each response as a "
                             "server-sent event")
    error = errors.from_triton(message, None, T.TEXT_INPUT, lambda field: field)
    status = error.status
    if status == 500 and StageError.parse(message) is None and upstream_status != 200:
        status = upstream_status  # Triton's own words (a missing input, an unknown model): its status stands
    return JSONResponse(status_code=status, content=parsed, headers=error.headers())


def generate_schema(inputs: tuple[dict, ...]) -> dict:
    """A `/generate` body's JSON schema for a model with these config `inputs`: each input by name, typed as
    `_check_generate_body` checks it (its datatype's range, a generation setting's own range), required unless
    optional; other keys (no NUL in them) are Triton's request parameters."""
    properties, required = {}, []
    for spec in inputs:
        name = spec["name"]
        datatype = spec["data_type"].removeprefix("TYPE_").replace("STRING", "BYTES")
        setting = BY_TENSOR.get(name)
        allowed = setting.allowed if setting is not None else DATATYPE_RANGES.get(datatype)
        if datatype in ("BOOL", "BYTES"):
            value: dict = {"type": "boolean" if datatype == "BOOL" else "string"}
        else:
            value = {"type": "integer" if allowed.integer else "number"}
            for key, bound in (("minimum", allowed.low), ("maximum", allowed.high)):
                if bound is not None:
                    value[key] = bound
            if allowed.low_open:
                value["exclusiveMinimum"] = value.pop("minimum")
        properties[name] = {"anyOf": [value, {"type": "array", "items": value}], "description": datatype}
        if not spec.get("optional"):
            required.append(name)
    return {"type": "object", "properties": properties, "required": required,
            "propertyNames": {"pattern": "^[^\\u0000]*$"}}
