"""The published API: `GET /openapi.json` (OpenAPI 3.1), `/docs` (Swagger UI) and `/redoc`, unless the front
door's `docs` setting is off (serving/config.py).

The document is FastAPI's, from the routes: their operation ids, parameters and answers (serving/schemas.py), plus
the request bodies from the models the routes validate with (chat and completions: serving/protocol.py; speech,
images and `/v2` generate: the models beside their routes), with the limits of the running pipeline filled in:
the served model names, the diffusion stage's sizes, steps and guidance range, and the inputs of the first served
chat entry point (read from Triton once; 503 while Triton cannot say). Chat and completions bodies also carry
protocol.py's request-field policy: every field the OpenAI reference marks nullable takes null, the fields that
describe the client are listed (any value), the known fields this server does not serve take only the values
that ask for what it does anyway, any other field is refused (`additionalProperties: false`); and the checks
that Pydantic's types do not say (`check()`) are stated as schema rules, so a request the schema allows is one
the front door takes (up to what only the stages can know: the context length, the media's contents, the
chat template's rules for the last message).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from omni_backend.serving import errors, protocol, schemas
from omni_backend.serving.front_door import door_of
from omni_backend.serving.routes import images, triton_v2
from omni_backend.stages import tts_audio
from omni_backend.stages.diffusion import ImageLimits
from omni_backend.stages.tts_options import voice_names
from omni_backend.vocabulary import DATATYPE_RANGES

TITLE = "omni_backend OpenAI-compatible front door"
VERSION = "0.1.0"  # pyproject.toml's
DESCRIPTION = (
    "OpenAI-compatible chat, completions, speech and image generation over Triton, and Triton's own `/v2` API. "
    "Errors are OpenAI error objects (`/v2`: Triton's `{\"error\": message}`). With an API key set, `/v1/*` and "
    "`/v2/*` (except health) need `Authorization: Bearer <key>`. Every GET also answers HEAD. Request bodies may "
    "be gzip- or deflate-encoded. Manual: docs/api.md.")
COMPONENT = "#/components/schemas/"

router = APIRouter()


@dataclass(frozen=True)
class Facts:
    """What the document states that only the running pipeline knows.

    Attributes:
        models: the served chat models (ServingConfig.models).
        image_limits: the diffusion stage's limits (from its config on Triton).
        generate_inputs: the first served model's inputs, as its Triton config lists them.
    """

    models: tuple[str, ...]
    image_limits: ImageLimits
    generate_inputs: tuple[dict, ...]


@router.get("/openapi.json", include_in_schema=False)
async def openapi_document(request: Request) -> JSONResponse:
    """The OpenAPI document (built once Triton can say the pipeline's limits; 503 until then)."""
    state = request.app.state
    if getattr(state, "openapi", None) is None:
        state.openapi = document(request.app, await gather_facts(request))
    return JSONResponse(state.openapi)


@router.get("/docs", include_in_schema=False)
async def swagger_ui():
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{TITLE} - Swagger UI")


@router.get("/redoc", include_in_schema=False)
async def redoc():
    return get_redoc_html(openapi_url="/openapi.json", title=f"{TITLE} - ReDoc")


async def gather_facts(request: Request) -> Facts:
    """The pipeline's limits from Triton.

    Raises:
        OpenAIError: 503 while Triton cannot say them.
    """
    door = door_of(request)
    models = door.config.models
    limits = await door.images.limits()
    config = await triton_v2.model_config(door, models[0])
    if config is None:
        raise errors.unavailable(f"Triton does not know the served model '{models[0]}' (yet)")
    return Facts(models, limits, tuple(config.get("input", [])))


def document(app: FastAPI, facts: Facts) -> dict:
    """The OpenAPI 3.1 document of `app`'s routes with the pipeline's `facts`."""
    with warnings.catch_warnings():  # one operation id per route, which FastAPI gives each of its methods
        warnings.filterwarnings("ignore", "Duplicate Operation ID", UserWarning)
        doc = get_openapi(title=TITLE, version=VERSION, description=DESCRIPTION, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for path in doc["paths"].values():
        path.pop("head", None)  # HEAD mirrors GET (the description says so)
        for method, operation in path.items():
            operation["responses"].pop("422", None)  # FastAPI's validation answer; ours is a 400
            if method != "get" and "get" in path:  # the catch-all's POST
                operation["operationId"] += method.capitalize()
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for model in (*schemas.BODY_MODELS.values(), *schemas.CONTENT_PARTS, *schemas.STREAM_CHUNKS):
        add_component(components, model)
    for model in (protocol.ChatCompletionRequest, protocol.CompletionRequest):
        field_policy(components[model.__name__], model)
    chat_rules(components)
    completion_rules(components[protocol.CompletionRequest.__name__])
    for name, model in schemas.BODY_MODELS.items():
        if "model" in model.model_fields:  # the served models, and the names the endpoint answers to besides
            model_names = (*getattr(model, "MODEL_NAMES", ()), *facts.models)
            components[name]["properties"]["model"]["enum"] = list(dict.fromkeys(model_names))
    images.document_limits(components[images.ImageGenerationRequest.__name__], facts.image_limits)
    components[triton_v2.GENERATE_BODY] = triton_v2.generate_schema(facts.generate_inputs)
    return doc


def add_component(components: dict, model) -> None:
    """`model`'s JSON schema (validation side) and the models it nests, as components."""
    schema = model.model_json_schema(ref_template=COMPONENT + "{model}")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema


def nullable(schema: dict) -> dict:
    """`schema` or null (its title, description and default kept outside)."""
    if schema.get("type") == "null" or {"type": "null"} in schema.get("anyOf", []):
        return schema
    outer = {key: schema.pop(key) for key in ("title", "description", "default") if key in schema}
    return {"anyOf": [schema, {"type": "null"}], **outer}


def field_policy(schema: dict, model: type) -> None:
    """protocol.py's request-field policy (the module docstring) on a chat or completions body schema."""
    properties = schema["properties"]
    for name in properties:
        if name not in model.NOT_NULLABLE:
            properties[name] = nullable(properties[name])
    for name in sorted(protocol.DESCRIPTIVE_FIELDS - properties.keys()):
        properties[name] = {"description": "Describes the client or its bookkeeping: accepted, no effect on the "
                                           "answer."}
    for name, allowed in model.NOT_SERVED.items():
        if name in properties:
            continue
        said = "null" if not allowed else "null or " + " or ".join(repr(value) for value in allowed)
        properties[name] = {"enum": [*allowed, None], "description": f"Not served by this server: only {said} "
                                                                     "(what it does anyway); else a 400."}
    schema["additionalProperties"] = False


def _set(schema: dict, name: str, rule: dict, keep: tuple[str, ...] = ("description", "default")) -> None:
    """Replace property `name`'s schema by `rule`, keeping its description and default."""
    old = schema["properties"][name]
    schema["properties"][name] = {**rule, **{k: old[k] for k in keep if k in old}}


def _either(name: str, unset: dict, then: dict) -> dict:
    """A rule: property `name` is absent or matches `unset`, or the body matches `then` (an if/then without
    the `not` that test generators cannot invert)."""
    return {"anyOf": [{"properties": {name: unset}}, then]}


NULL = {"type": "null"}


NON_EMPTY_STOP = {"anyOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "items": {"type": "string", "minLength": 1}}, {"type": "null"}]}
NONE_OR_EMPTY_LIST = {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}


NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}  # OpenAI's rule for schema and function names
OBJECT_OR_NULL = {"type": ["object", "null"]}
NON_EMPTY = {"type": "string", "minLength": 1}
RESPONSE_FORMAT = {"anyOf": [NULL, {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "json_object"]}}}, {
    "type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["name"], "properties": {
            "name": NAME, "strict": {"type": ["boolean", "null"]}, "schema": OBJECT_OR_NULL}}}}],
    "description": "text, json_object, or json_schema {name, schema, strict}: the answer follows the schema "
                   "(a schema this server cannot compile is a 400 naming it)."}
STRUCTURED_OUTPUTS = {"anyOf": [NULL, {"type": "object", "properties": {
    "json": {"type": ["object", "string", "null"]}, "regex": {"anyOf": [NULL, NON_EMPTY]},
    "choice": {"anyOf": [NULL, {"type": "array", "items": NON_EMPTY, "minItems": 1}]},
    "grammar": {"anyOf": [NULL, NON_EMPTY]}, "json_object": {"enum": [True, False, None]}}}],
    "description": "vLLM's: exactly one of json (a JSON schema), regex, choice, grammar (EBNF) or json_object; "
                   "not with a response_format other than text."}


def _common_rules(schema: dict) -> list[dict]:
    """The rules of `protocol._Request.check_common` (stop strings not empty, no logit_bias, stream_options only
    with stream) and the shapes serving/structured.py reads (whether a schema, regex or grammar compiles is for
    the grammar compiler to say)."""
    _set(schema, "stop", NON_EMPTY_STOP)
    _set(schema, "logit_bias", {"anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}]})
    _set(schema, "response_format", RESPONSE_FORMAT, keep=("default",))
    _set(schema, "structured_outputs", STRUCTURED_OUTPUTS, keep=("default",))
    return [_either("stream_options", NULL, {"properties": {"stream": {"const": True}}, "required": ["stream"]})]


TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": NAME, "description": {"type": ["string", "null"]}, "parameters": OBJECT_OR_NULL}}}}
TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string"},
        "arguments": {"type": "string", "description": "A JSON object, as a string."}}}}}
TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required", None]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}}}}}],
    "description": "\"required\" and a named function need tools (the name one of theirs) and constrain the "
                   "answer to the functions' parameters (not with response_format or structured_outputs)."}


def chat_rules(components: dict) -> None:
    """ChatCompletionRequest.check and messages_json as schema rules."""
    schema = components[protocol.ChatCompletionRequest.__name__]
    rules = _common_rules(schema)
    messages = schema["properties"]["messages"]
    messages["minItems"] = 1
    message = components[protocol.ChatMessage.__name__]
    parts = {"oneOf": [{"$ref": COMPONENT + part.__name__} for part in schemas.CONTENT_PARTS]}
    _set(message, "content", {"anyOf": [{"type": "string"}, {"type": "array", "items": parts}]}, keep=())
    message["required"] = [*message["required"], "content"]
    _set(message, "tool_calls", {"anyOf": [NULL, {"type": "array", "items": TOOL_CALL}]})
    _set(message, "function_call", {"type": "null"})
    _set(schema, "functions", NONE_OR_EMPTY_LIST)
    _set(schema, "tools", {"anyOf": [NULL, {"type": "array", "items": TOOL}]})
    _set(schema, "tool_choice", TOOL_CHOICE, keep=("default",))
    _set(schema, "modalities", {"anyOf": [{"type": "array", "items": {"enum": ["text", "audio"]}},
                                          {"type": "null"}]})
    formats = [name for name, ours in protocol.CHAT_AUDIO_FORMATS.items() if ours in tts_audio.formats()]
    audio = components[protocol.AudioOutput.__name__]
    _set(audio, "format", {"enum": formats})
    _set(audio, "voice", {"anyOf": [{"enum": voice_names()}, {
        "type": "object", "properties": {"id": {"enum": voice_names()}}, "required": ["id"]}]})
    written = {"properties": {"audio": NULL, "modalities": {
        "anyOf": [NULL, {"type": "array", "items": {"const": "text"}}]}}}
    spoken = {"required": ["audio"], "properties": {
        "audio": {"type": "object"},
        "modalities": {"anyOf": [NULL, {"type": "array", "maxItems": 0}, {"type": "array", "contains": {"const": "audio"}}]},
        "n": {"enum": [1, None]}, "logprobs": {"enum": [False, None]}, "tools": NONE_OR_EMPTY_LIST},
        "anyOf": [{"properties": {"stream": {"enum": [False, None]}}},
                  {"properties": {"audio": {"properties": {"format": {"const": "pcm16"}}}}}]}
    rules += [
        {"anyOf": [written, spoken]},
        _either("top_logprobs", NULL, {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}),
        _either("continue_final_message", {"enum": [False, None]},
                {"properties": {"add_generation_prompt": {"const": False}}, "required": ["add_generation_prompt"]}),
    ]
    schema["allOf"] = rules


def completion_rules(schema: dict) -> None:
    """CompletionRequest.check and prompts() as schema rules (`best_of` equal to `n` is said in words)."""
    rules = _common_rules(schema)
    token = {"type": "integer", "minimum": 0, "maximum": DATATYPE_RANGES["INT32"].high,
             "description": "A token id, below the model's vocabulary size (preprocess checks it)."}
    tokens = {"type": "array", "items": token, "minItems": 1}
    _set(schema, "prompt", {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        tokens, {"type": "array", "items": tokens, "minItems": 1}]})
    _set(schema, "suffix", {"anyOf": [{"type": "string", "maxLength": 0}, {"type": "null"}]})
    best_of = schema["properties"]["best_of"]
    best_of["description"] = "null or equal to n (this server returns every sequence it generates)."
    schema["allOf"] = rules

