"""Serving one running llm service as an NVIDIA Dynamo LLM worker (ai-dynamo-runtime 1.6): registration, the
generate endpoint, KV events and load metrics.

Two entry points share `serve_service`: the standalone worker (`python -m omni_backend.launch.dynamo`, which builds
its own service) and the Triton llm stage with the `dynamo_endpoint` setting (`DynamoThread`: the stage's own
service, registered from inside tritonserver's Python-backend process, so Triton's ensembles and Dynamo's frontend
share one engine).

What `serve_service` does:
- `register_llm` (Dynamo's `register_model`) of the engine's Hugging Face folder with `ModelInput.Tokens`, so the
  frontend tokenizes, applies the chat template and detokenizes, and the KV router hashes prompts in our
  `block_size`;
- the `generate` endpoint (`Handler.generate`): token ids in, token ids out (stages/llm/dynamo_protocol.py); a
  client that goes away (Dynamo stops the request's context) aborts the request in the engine, freeing its blocks;
- KV events: the engine's prefix-cache events go out as vLLM's ZMQ stream (ops/kv_event_stream.py, the `kv_events`
  setting, which must bind) and Dynamo's `KvEventPublisher`, pointed at that socket (`zmq_endpoint`), relays them
  to the KV router over the event plane, as Dynamo's vLLM worker does;
- load metrics: `WorkerMetricsPublisher.publish(kv_used_blocks=...)` every LOAD_INTERVAL_S; the capacity in the
  registration's `ModelRuntimeConfig`;
- health: our canary request (`dynamo_protocol.health_check_payload`) for Dynamo's endpoint health checks.

Discovery and events come from Dynamo's environment: `ETCD_ENDPOINTS`, `NATS_SERVER` (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from omni_backend.stages.llm import dynamo_protocol as protocol
from omni_backend.stages.llm.async_sink import AsyncSink
from omni_backend.stages.llm.parameters import LLMStageSettings
from omni_backend.stages.llm.service import LLMService
from omni_backend.vocabulary import StageError

if TYPE_CHECKING:  # the Dynamo packages are optional (requirements-dynamo.txt): imported where used
    from dynamo.llm import HttpError, ModelRuntimeConfig, WorkerMetricsPublisher
    from dynamo.runtime import DistributedRuntime

logger = logging.getLogger(__name__)

LOAD_INTERVAL_S = 0.5  # how often the KV router hears the worker's used blocks
STOP_TIMEOUT_S = 30.0  # how long DynamoThread.stop waits for Dynamo to drain before leaving the daemon thread


class Handler:
    """The generate endpoint over one LLMService (request ids are the worker's own: Dynamo's may repeat across
    retries)."""

    def __init__(self, service: LLMService):
        self.service = service
        self._ids = itertools.count()

    async def generate(self, request: dict, context) -> AsyncIterator[dict]:
        """Stream Dynamo engine output chunks for one preprocessed request (dynamo_protocol.py).

        Raises:
            HttpError: 400 for a request the engine or this worker refuses, 429 when the engine holds as many
                requests as it may queue, 503 when it is out of service, 500 when it failed the request.
        """
        engine = self.service.engine
        request_id = f"dyn-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        sink = AsyncSink(loop, lambda: context.is_stopped() or context.is_killed())
        try:
            params = protocol.sampling_params(request, engine.max_model_len)
            self.service.submit(request_id, protocol.prompt_token_ids(request), params, sink)
        except Exception as exc:  # noqa: BLE001 (each refusal maps to its status: StageError.of)
            raise _http_error(StageError.of(exc, "llm")) from None
        finished = False
        try:
            async for output in sink:
                finished = output.finished
                yield protocol.chunk(output)
        except StageError as error:
            finished = True  # the engine ended the request itself: nothing left to abort
            raise _http_error(error) from None
        finally:
            if not finished:  # the caller stopped reading (disconnect, cancellation): end it in the engine
                logger.info("request %s (Dynamo's %s) ended by its caller; aborting it in the engine", request_id,
                            context.id())
                sink.cancel()


def _http_error(error: StageError) -> HttpError:
    from dynamo.llm import HttpError

    return HttpError(error.kind.http_status, error.message)


def runtime_config(service: LLMService) -> ModelRuntimeConfig:
    """The capacity the frontend and KV router read from the registration."""
    from dynamo.llm import ModelRuntimeConfig

    engine = service.engine
    config = ModelRuntimeConfig()
    config.context_length = engine.max_model_len
    config.total_kv_blocks = engine.runner.block_manager.num_blocks
    config.max_num_seqs = engine.config.max_num_seqs
    config.max_num_batched_tokens = engine.config.max_num_batched_tokens
    config.kv_event_publishing_enabled = True
    return config


async def publish_load(service: LLMService, publisher: WorkerMetricsPublisher) -> None:
    """Tell the router the KV blocks in use every LOAD_INTERVAL_S (plain attribute reads of the engine's)."""
    blocks = service.engine.runner.block_manager
    while True:
        publisher.publish(0, kv_used_blocks=blocks.num_blocks - blocks.num_free_blocks)
        await asyncio.sleep(LOAD_INTERVAL_S)


async def serve_service(service: LLMService, runtime: DistributedRuntime, endpoint_path: str,
                        served_model_name: str | None = None, kv_events_topic: str = "") -> None:
    """Register the started `service` as a Dynamo LLM worker at `endpoint_path` ("namespace.component.endpoint")
    and serve it until `runtime.shutdown()` (then Dynamo drains; the service itself stays the caller's).

    Args:
        service: a started service whose engine publishes KV events on an endpoint that binds
            (`service.core.kv_events`).
        runtime: Dynamo's `DistributedRuntime` on the running loop.
        served_model_name: the name clients ask for (None: the engine's model folder as given).
        kv_events_topic: the topic frame of the engine's KV-event messages (the `kv_events_topic` setting).

    Raises:
        ValueError: the engine publishes no KV events; Dynamo's errors when etcd or NATS cannot be reached.
    """
    from dynamo.llm import KvEventPublisher, ModelInput, ModelType, WorkerMetricsPublisher, WorkerType, register_llm

    if service.core.kv_events is None:
        raise ValueError("a Dynamo worker's engine must publish KV events (the kv_events setting) for the KV router")
    model = service.engine.config.model_path
    block_size = service.engine.config.block_size
    endpoint = runtime.endpoint(endpoint_path)
    with contextlib.ExitStack() as cleanup:  # undone in reverse, whichever step fails
        kv_publisher = KvEventPublisher(endpoint=endpoint, kv_block_size=block_size,
                                        zmq_endpoint=service.core.kv_events.endpoint.replace("*", "127.0.0.1"),
                                        zmq_topic=kv_events_topic)
        cleanup.callback(kv_publisher.shutdown)
        load = WorkerMetricsPublisher()
        await load.create_endpoint(endpoint)
        cleanup.callback(asyncio.create_task(publish_load(service, load)).cancel)
        await register_llm(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint, model,
                           served_model_name, worker_type=WorkerType.Aggregated, kv_cache_block_size=block_size,
                           runtime_config=runtime_config(service))
        bos = service.engine.tokenizer.bos_token_id
        logger.info("serving %s as Dynamo endpoint %s (pid %d)", model, endpoint_path, os.getpid())
        await endpoint.serve_endpoint(Handler(service).generate, graceful_shutdown=True,
                                      health_check_payload=protocol.health_check_payload(
                                          bos if bos is not None else 0))


class DynamoThread:
    """`serve_service` for a service that runs inside another server (the Triton llm stage): an asyncio loop on a
    daemon thread, with Dynamo's runtime (etcd discovery, TCP request plane) on it.

    Args:
        service: the started service to serve.
        endpoint_path: "namespace.component.endpoint".
        kv_events_topic: as `serve_service`'s.
    """

    def __init__(self, service: LLMService, endpoint_path: str, kv_events_topic: str = ""):
        self.service = service
        self.endpoint_path = endpoint_path
        self.kv_events_topic = kv_events_topic
        self._loop = asyncio.new_event_loop()
        self._runtime: DistributedRuntime | None = None
        self._stopping = False  # set by a stop that came before the runtime existed
        self._thread = threading.Thread(target=self._run, name="llm-dynamo", daemon=True)

    def start(self) -> None:
        """Start serving on the thread (registration happens there; a failure is logged, Triton keeps serving)."""
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except Exception:
            logger.exception("serving the llm stage on Dynamo endpoint %s failed; Triton keeps serving it",
                             self.endpoint_path)
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        from dynamo.runtime import DistributedRuntime

        self._runtime = DistributedRuntime(asyncio.get_running_loop(), "etcd", "tcp")
        if self._stopping:
            return
        await serve_service(self.service, self._runtime, self.endpoint_path, kv_events_topic=self.kv_events_topic)

    def stop(self) -> None:
        """Shut Dynamo's runtime down (it deregisters and drains) and wait up to STOP_TIMEOUT_S for the thread."""
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed in between: nothing left to stop
                self._loop.call_soon_threadsafe(self._shutdown)
            self._thread.join(STOP_TIMEOUT_S)

    def _shutdown(self) -> None:
        self._stopping = True
        if self._runtime is not None:
            self._runtime.shutdown()


def serve_stage_on_dynamo(service: LLMService, parameters: dict[str, str]) -> DynamoThread | None:
    """The Triton llm stage's Dynamo worker: its started `service` served at the `dynamo_endpoint` setting of its
    string parameters, on a started DynamoThread (None when the setting is empty; `parse_parameters` already
    refused one without `kv_events` that binds)."""
    stage = LLMStageSettings.from_strings(parameters)
    if not stage.dynamo_endpoint:
        return None
    thread = DynamoThread(service, stage.dynamo_endpoint, stage.kv_events_topic)
    thread.start()
    return thread
