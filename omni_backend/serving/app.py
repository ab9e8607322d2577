"""The OpenAI-compatible HTTP front door: FastAPI routes over the Triton pipeline (see pipeline.py).

Request checks run in the order a client can act on: API key (401), content type (415), body size (413), JSON
(400), model (404, the same on every endpoint), fields (400 naming the field), admission (429), then Triton
(400 for its INVALID_ARG, 503 + Retry-After when unavailable, 500 for faults). Streamed answers are
server-sent events whose chunks follow OpenAI's ChatCompletionChunk / Completion schemas.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import aiohttp
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from sse_starlette import ServerSentEvent
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from omni_backend.ops.metrics import stages_ready
from omni_backend.serving.sse import ReleasingEventSourceResponse
from omni_backend.serving import errors, images, protocol, speech
from omni_backend.serving.config import ServingConfig
from omni_backend.serving.errors import OpenAIError, invalid
from omni_backend.serving.metrics import FrontDoorMetrics, ObserveRequests, StageWatch, triton_metrics
from omni_backend.serving.pipeline import Prepared, Step, TritonPipeline
from omni_backend.serving.v2_proxy import V2Proxy

logger = logging.getLogger("omni_backend.serving")

SYSTEM_FINGERPRINT = "fp_omni_backend"


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class FrontDoor:
    """State shared by the routes: the pipelines, counters, admission and the HTTP session for Triton."""

    def __init__(self, config: ServingConfig):
        self.config = config
        self.session: aiohttp.ClientSession | None = None
        self.watch = StageWatch(self.http, config.triton_metrics_url)  # stages whose stub died (heartbeats)
        self.pipelines = {name: TritonPipeline(config.triton_grpc, name, self.watch) for name in config.models}
        self.metrics = FrontDoorMetrics()
        self.in_flight = 0
        self.v2 = V2Proxy(config, self)

    async def close(self) -> None:
        for pipeline in self.pipelines.values():
            await pipeline.close()
        for backend in (getattr(self, "speech", None), getattr(self, "images", None)):  # speech.py, images.py
            if backend is not None:
                await backend.close()
        if self.session is not None:
            await self.session.close()

    def http(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession()
        return self.session

    def pipeline_for(self, body: dict) -> TritonPipeline:
        """The served model a request names (404 model_not_found when unknown; a missing model is a 400)."""
        model = body.get("model")
        if not isinstance(model, str):
            return None  # the schema check names the field
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


# ---------------------------------------------------------------------------------------------------------
# Request bodies


_JSON_TYPE = re.compile(r"^application/([a-z0-9.+-]*\+)?json$")


async def read_json(request: Request, limit: int) -> dict:
    """The request body as a JSON object.

    Raises:
        OpenAIError: 415 unless the content type is JSON, 413 over `limit` bytes, 400 for bad JSON (also nested
            too deeply, or with an integer of more than 4300 digits) or a body that is not an object.
    """
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if not _JSON_TYPE.match(media_type):
        shown = f"'{media_type}'" if media_type else "no Content-Type"
        raise OpenAIError(415, f"Unsupported media type {shown}: send the body as application/json",
                          "invalid_request_error", None, "unsupported_media_type")
    too_large = OpenAIError(413, f"request body is larger than the limit of {limit} bytes",
                            "invalid_request_error", None, "request_too_large")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except RecursionError:  # e.g. 100,000 '[': the decoder recurses once per level
        raise invalid("We could not parse the JSON body of your request: it is nested too deeply", None,
                      "invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        reason = str(exc).split(";")[0]  # the digit limit's advice (sys.set_int_max_str_digits) is not for clients
        raise invalid(f"We could not parse the JSON body of your request: {reason}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__ if body is not None else 'null'}",
                      None, "invalid_body")
    return body


async def run_admitted(door, request: Request, generation, start, stream_events=None, collect=None):
    """Run `generation` holding one of the front door's admission slots (429 when none is free).

    Awaits `start()` and then either streams `stream_events` (an async iterator of SSE events; the generation is
    closed and the slot freed however the stream ends) or awaits `collect()` and returns its result (`start` and
    `collect`: functions returning coroutines, called only once the slot is held). Until then a client that leaves ends the work and gets a 499 response; any error
    closes the generation and frees the slot before it propagates.

    Returns:
        the SSE Response, a 499 Response, or what `collect` returned.
    """
    admission = door.admitted()
    await admission.__aenter__()

    async def release() -> None:
        await generation.close()
        await admission.__aexit__(None, None, None)

    try:
        await until_disconnect(request, start())
        if stream_events is not None:
            return ReleasingEventSourceResponse(stream_events, release=release, ping=15, sep="\n",
                                                shutdown_grace_s=door.config.graceful_shutdown_s)
        result = await until_disconnect(request, collect())
    except ClientGone:
        await release()
        return Response(status_code=499)
    except BaseException:
        await release()
        raise
    await admission.__aexit__(None, None, None)
    return result


async def until_disconnect(request: Request, work):
    """Await `work` (a coroutine) unless the client disconnects first; then cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - the cancelled work's outcome no longer matters
                pass


# ---------------------------------------------------------------------------------------------------------
# Generation shared by chat and completions


class Choice:
    """One choice being generated: its index, prompt and Triton stream."""

    def __init__(self, index: int, prepared: Prepared, steps: AsyncIterator[Step] | None):
        self.index, self.prepared, self.steps = index, prepared, steps
        self.first: Step | None = None

    async def start(self) -> None:
        """Wait for the first response (so that errors before any text still get their own HTTP status)."""
        if self.steps is None:  # max_tokens 0: validated, nothing to generate
            self.first = Step("", "length", self.prepared.prompt_tokens, 0, None)
        else:
            self.first = await self.steps.__anext__()

    async def all_steps(self) -> AsyncIterator[Step]:
        yield self.first
        if self.steps is not None and not self.first.finish_reason:
            async for step in self.steps:
                yield step

    async def close(self) -> None:
        if self.steps is not None:
            await self.steps.aclose()


class Generation:
    """The choices of one request: prepared, started, and merged in arrival order."""

    def __init__(self, door: FrontDoor, pipeline: TritonPipeline, request_id: str, prompt_field: str):
        self.door, self.pipeline, self.request_id, self.prompt_field = door, pipeline, request_id, prompt_field
        self.choices: list[Choice] = []

    async def start(self, prompts: list[dict], n: int, max_tokens: int | None, seed: int | None) -> None:
        """Preprocess every (prompt, choice) and wait for each choice's first response.

        Choice `i` of a prompt uses seed + i so that seeded choices differ (and repeat across calls).
        """
        jobs = []
        for p, values in enumerate(prompts):
            for i in range(n):
                choice_values = dict(values, random_seed=seed + i) if seed is not None and n > 1 else values
                jobs.append(self.pipeline.prepare(choice_values, max_tokens, self.prompt_field,
                                                  f"{self.request_id}-{p * n + i}"))
        prepared = await asyncio.gather(*jobs, return_exceptions=True)
        for item in prepared:
            if isinstance(item, BaseException):
                raise item
        for index, prep in enumerate(prepared):
            steps = (self.pipeline.generate(prep, self.prompt_field, f"{self.request_id}-{index}")
                     if prep.generate else None)
            self.choices.append(Choice(index, prep, steps))
        results = await asyncio.gather(*(c.start() for c in self.choices), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.close()
            raise failures[0]

    async def close(self) -> None:
        for choice in self.choices:
            await choice.close()

    async def merged(self) -> AsyncIterator[tuple[Choice, Step]]:
        """(choice, step) pairs from all choices as they arrive; closing this cancels the unfinished ones."""
        if len(self.choices) == 1:
            choice = self.choices[0]
            async for step in choice.all_steps():
                yield choice, step
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice):
            try:
                async for step in choice.all_steps():
                    await queue.put((choice, step, None))
            except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((choice, None, exc))
            finally:
                await queue.put((choice, None, None))

        tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
        try:
            remaining = len(tasks)
            while remaining:
                choice, step, exc = await queue.get()
                if exc is not None:
                    raise exc
                if step is None:
                    remaining -= 1
                    continue
                yield choice, step
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()


def _check_finish(step: Step) -> None:
    if step.finish_reason == "abort":
        raise errors.unavailable("the request was aborted by the server (shutting down or out of KV cache)")


async def collect(generation: Generation) -> list[dict]:
    """Run every choice to the end: per choice its text, logprob entries, finish reason and token counts."""
    out = [{"text": [], "logprobs": None, "finish_reason": None, "prompt_tokens": c.prepared.prompt_tokens,
            "completion_tokens": 0} for c in generation.choices]
    async for choice, step in generation.merged():
        _check_finish(step)
        item = out[choice.index]
        item["text"].append(step.text)
        if step.logprobs is not None:
            item["logprobs"] = (item["logprobs"] or []) + step.logprobs
        item["completion_tokens"] = step.completion_tokens
        if step.finish_reason:
            item["finish_reason"] = step.finish_reason
            item["prompt_tokens"] = step.prompt_tokens or item["prompt_tokens"]
    for item in out:
        item["text"] = "".join(item["text"])
    return out


def total_usage(generation: Generation, results: list[dict], n: int) -> dict:
    """Usage over all choices: each prompt counted once, every choice's completion tokens."""
    prompt = sum(results[i]["prompt_tokens"] for i in range(0, len(results), n))
    completion = sum(r["completion_tokens"] for r in results)
    return protocol.usage(prompt, completion)


# ---------------------------------------------------------------------------------------------------------
# The app


def create_app(config: ServingConfig) -> FastAPI:
    """The FastAPI application for `config` (run it with uvicorn; see `omni_backend.serving.__main__`)."""
    door = FrontDoor(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await door.close()

    app = FastAPI(title="omni_backend OpenAI-compatible front door", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.door = door

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect):
        # The client left while its body was being read (seen in the cancel storm): nobody to answer, no fault to
        # log. 499 is what the metrics count it as.
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        error = invalid(f"invalid request: {exc.errors()[0].get('msg')}", None)
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

    async def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or token.strip() != config.api_key:
            raise OpenAIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                              "authentication_error", None, "invalid_api_key")

    v1 = APIRouter(dependencies=[Depends(check_key)])

    @app.get("/health")
    async def health():
        down = {stage: message for p in door.pipelines.values() for stage, message in p.down_stages.items()}
        if down:  # a unary stage's stub died (Triton keeps it READY and restarts no stub): pipeline.down_stages
            raise errors.unavailable("stage process dead: " + "; ".join(f"{s}: {m}" for s, m in sorted(down.items())))
        ready = all([await p.ready() for p in door.pipelines.values()])
        if not ready:
            raise errors.unavailable("Triton or a served model is not ready")
        # Triton 2.51 cannot mark itself unready from a Python model, and keeps a model READY after its stub
        # process died: a stage's governor refusing new requests (critical GPU temperature) and a stage whose
        # heartbeat stopped show on the metrics port (omni_backend/ops/metrics.py stages_ready).
        ready, reason = stages_ready(await triton_metrics(door.http(), config.triton_metrics_url))
        if not ready:
            raise errors.unavailable(reason)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        triton = await triton_metrics(door.http(), config.triton_metrics_url)
        body = triton.rstrip("\n") + "\n" + door.metrics.text().decode()
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def model_card(name: str) -> dict:
        info = await door.pipelines[name].info()
        return {"id": name, "object": "model", "created": info.created, "owned_by": "omni_backend",
                "root": name, "parent": None, "max_model_len": info.max_model_len}

    @v1.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [await model_card(name) for name in door.pipelines]}

    @v1.get("/v1/models/{model:path}")
    async def get_model(model: str):
        if model not in door.pipelines:
            raise errors.model_not_found(model)
        return await model_card(model)

    @v1.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request, config.max_body_bytes)
        pipeline = door.pipeline_for(body)
        if speech.wants_audio(body):  # modalities ["text", "audio"]: omni_backend/serving/speech.py
            return await speech.chat_with_audio(request, door, body, pipeline)
        req = protocol.parse_request(protocol.ChatCompletionRequest, body)
        values = {"text_input": json.dumps(req.messages_json(), ensure_ascii=False), **req.sampling_values(),
                  "stream": req.stream}
        if req.logprobs_count() is not None:
            values["logprobs"] = req.logprobs_count()
        return await serve(request, "chat", pipeline, req, [values], req.completion_limit, "messages")

    @v1.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request, config.max_body_bytes)
        pipeline = door.pipeline_for(body)
        req = protocol.parse_request(protocol.CompletionRequest, body)
        info = await pipeline.info()
        prompts = []
        for item in req.prompts():
            values = {**req.sampling_values(), "stream": req.stream}
            if isinstance(item, str):
                values["text_input"] = item
            elif not info.accepts_token_ids:
                raise invalid("this model does not take prompts as token ids", "prompt")
            else:
                values.update(text_input="", prompt_token_ids=item)
            if req.logprobs is not None:
                values["logprobs"] = req.logprobs
            prompts.append(values)
        return await serve(request, "completion", pipeline, req, prompts, req.max_tokens, "prompt")

    async def unsupported(request: Request):
        body = await read_json(request, config.max_body_bytes)
        if door.pipeline_for(body) is None:
            raise invalid("'model' is a required property", "model")
        raise invalid(f"The model `{body['model']}` does not support {request.url.path}", "model",
                      "model_not_supported")

    for path in ("/v1/audio/transcriptions", "/v1/embeddings"):
        v1.add_api_route(path, unsupported, methods=["POST"])
    speech.register(v1, door)  # POST /v1/audio/speech
    images.register(v1, door)  # POST /v1/images/generations

    async def serve(request: Request, kind: str, pipeline: TritonPipeline, req, prompts: list[dict],
                    max_tokens: int | None, prompt_field: str):
        started = time.monotonic()
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        request_id = protocol.new_id("chatcmpl" if kind == "chat" else "cmpl")
        generation = Generation(door, pipeline, request_id, prompt_field)

        async def start() -> None:
            await generation.start(prompts, req.n, max_tokens, req.seed)
            door.metrics.ttft.labels(endpoint).observe(time.monotonic() - started)

        if req.stream:
            return await run_admitted(door, request, generation, start,
                                      stream_events=stream_events(kind, req, generation, request_id))
        results = await run_admitted(door, request, generation, start, collect=lambda: collect(generation))
        if isinstance(results, Response):
            return results
        usage = total_usage(generation, results, req.n)
        door.metrics.prompt_tokens.inc(usage["prompt_tokens"])
        door.metrics.completion_tokens.inc(usage["completion_tokens"])
        return JSONResponse(build_response(kind, req, generation, results, usage, request_id))

    app.include_router(v1)
    app.include_router(door.v2.router(check_key))
    app.add_middleware(ObserveRequests, metrics=door.metrics)
    return app


def build_response(kind: str, req, generation: Generation, results: list[dict], usage: dict,
                   request_id: str) -> dict:
    """A non-streamed chat.completion or text_completion object."""
    choices = []
    for choice, result in zip(generation.choices, results):
        if kind == "chat":
            choices.append({"index": choice.index, "message": {"role": "assistant", "content": result["text"]},
                            "logprobs": protocol.chat_logprobs(result["logprobs"]),
                            "finish_reason": result["finish_reason"]})
        else:
            prefix = choice.prepared.prompt_text if req.echo else ""
            logprobs = None
            if req.logprobs is not None:
                logprobs = protocol.completion_logprobs(result["logprobs"] or [], len(prefix))
            choices.append({"index": choice.index, "text": prefix + result["text"], "logprobs": logprobs,
                            "finish_reason": result["finish_reason"]})
    return {"id": request_id, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": protocol.now(), "model": req.model, "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices, "usage": usage}


async def stream_events(kind: str, req, generation: Generation, request_id: str) -> AsyncIterator:
    """Server-sent events for a streamed answer: one chunk per delta, then usage (if asked), then [DONE].

    An error after the first chunk is sent as an `{"error": ...}` event (the status line is already out).
    """
    created = protocol.now()
    include_usage = req.include_usage
    object_name = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(choices: list[dict]) -> ServerSentEvent:
        body = {"id": request_id, "object": object_name, "created": created, "model": req.model,
                "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices}
        if include_usage:
            body["usage"] = None
        return ServerSentEvent(json.dumps(body, ensure_ascii=False))

    completion_tokens = {c.index: 0 for c in generation.choices}
    prompt_tokens = {c.index: c.prepared.prompt_tokens for c in generation.choices}
    text_offset = {c.index: 0 for c in generation.choices}
    try:
        if kind == "chat":
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for c in generation.choices])
        elif req.echo:
            for c in generation.choices:
                text_offset[c.index] = len(c.prepared.prompt_text)
                yield chunk([{"index": c.index, "text": c.prepared.prompt_text, "logprobs": None,
                              "finish_reason": None}])
        async for choice, step in generation.merged():
            _check_finish(step)
            i = choice.index
            completion_tokens[i] = step.completion_tokens
            if step.finish_reason and step.prompt_tokens:
                prompt_tokens[i] = step.prompt_tokens
            if step.text or step.logprobs:
                if kind == "chat":
                    yield chunk([{"index": i, "delta": {"content": step.text},
                                  "logprobs": protocol.chat_logprobs(step.logprobs), "finish_reason": None}])
                else:
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = protocol.completion_logprobs(step.logprobs or [], text_offset[i])
                    text_offset[i] += len(step.text)
                    yield chunk([{"index": i, "text": step.text, "logprobs": logprobs, "finish_reason": None}])
            if step.finish_reason:
                if kind == "chat":
                    yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": step.finish_reason}])
                else:
                    yield chunk([{"index": i, "text": "", "logprobs": None, "finish_reason": step.finish_reason}])
        if include_usage:
            n = req.n
            indices = sorted(prompt_tokens)
            usage = protocol.usage(sum(prompt_tokens[i] for i in indices[::n]), sum(completion_tokens.values()))
            body = {"id": request_id, "object": object_name, "created": created, "model": req.model,
                    "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [], "usage": usage}
            yield ServerSentEvent(json.dumps(body))
        yield ServerSentEvent("[DONE]")
    except OpenAIError as exc:
        yield ServerSentEvent(json.dumps(exc.body()))
        yield ServerSentEvent("[DONE]")
    finally:
        await generation.close()
