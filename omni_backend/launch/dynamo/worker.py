"""Our LLM engine as an NVIDIA Dynamo LLM worker (ai-dynamo-runtime 1.6): registration, the generate endpoint, KV
events and load metrics.

What runs in the worker process:
- the llm stage's service (`stages.llm.build.create_service`: engine, engine-loop and response threads) built from
  the same settings as the Triton llm stage (`OMNI_<NAME>`, `repository.Settings`), without Triton;
- `register_llm` (Dynamo's `register_model`) of the served Hugging Face folder with `ModelInput.Tokens`, so the
  frontend tokenizes, applies the chat template and detokenizes, and the KV router hashes prompts in our
  `block_size`;
- the `generate` endpoint (`Handler.generate`): token ids in, token ids out (launch/dynamo/protocol.py);
  a client that goes away (Dynamo stops the request's context) aborts the request in the engine, freeing its KV
  blocks;
- KV events: the engine's prefix-cache events go out as vLLM's ZMQ stream (ops/kv_event_stream.py, the `kv_events`
  setting, here an ipc socket of the worker's own unless set) and Dynamo's `KvEventPublisher`, pointed at that
  socket (`zmq_endpoint`), relays them to the KV router over the event plane, as Dynamo's vLLM worker does;
- load metrics: `WorkerMetricsPublisher.publish(kv_used_blocks=...)` every LOAD_INTERVAL_S; the capacity
  (`total_kv_blocks`, `max_num_seqs`, `max_num_batched_tokens`, `context_length`) goes in the registration's
  `ModelRuntimeConfig`;
- health: Dynamo's own system server (`DYN_SYSTEM_ENABLED=true`, `DYN_SYSTEM_PORT`: `/health`, `/live`), with our
  canary request (`protocol.health_check_payload`) for its endpoint health checks.

Discovery and events come from Dynamo's environment: `ETCD_ENDPOINTS`, `NATS_SERVER` (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omni_backend.launch.dynamo import protocol
from omni_backend.ops.kv_event_stream import binds
from omni_backend.repository import Settings
from omni_backend.stages.llm.async_sink import AsyncSink
from omni_backend.stages.llm.build import create_service
from omni_backend.stages.llm.service import LLMService
from omni_backend.vocabulary import StageError

if TYPE_CHECKING:  # the Dynamo packages are optional (requirements-dynamo.txt): imported where used
    from dynamo.llm import HttpError, ModelRuntimeConfig, WorkerMetricsPublisher

logger = logging.getLogger(__name__)

LOAD_INTERVAL_S = 0.5  # how often the KV router hears the worker's used blocks


@dataclass
class WorkerOptions:
    """Where the worker registers and what it serves.

    Attributes:
        model: the served Hugging Face folder (config, weights, tokenizer, chat template).
        served_model_name: the name clients ask for (None: the folder as given).
        namespace, component, endpoint: the generate endpoint's Dynamo path `namespace.component.endpoint`.
        discovery_backend: Dynamo's discovery ("etcd", "file", "kubernetes", "mem").
        request_plane: how requests reach the worker ("tcp" or "nats").
        settings: engine and llm-stage settings by operator name (`repository.Settings`, over `OMNI_<NAME>`).
    """

    model: str
    served_model_name: str | None = None
    namespace: str = "dynamo"
    component: str = "backend"
    endpoint: str = "generate"
    discovery_backend: str = "etcd"
    request_plane: str = "tcp"
    settings: dict[str, str] | None = None


class Handler:
    """The generate endpoint over one LLMService (request ids are the worker's own: Dynamo's may repeat across
    retries)."""

    def __init__(self, service: LLMService):
        self.service = service
        self._ids = itertools.count()

    async def generate(self, request: dict, context) -> AsyncIterator[dict]:
        """Stream Dynamo engine output chunks for one preprocessed request (protocol.py).

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


def llm_parameters(options: WorkerOptions, kv_events: str) -> dict[str, str]:
    """The llm stage's parameters for this worker: the settings (`OMNI_<NAME>` and `options.settings`), the served
    folder, and `kv_events` unless the settings name an endpoint already.

    Raises:
        ValueError: a setting the llm stage refuses, or a `kv_events` endpoint that connects (`tcp://HOST:PORT`):
            Dynamo's relay subscribes to the worker's stream, so the stream must bind.
    """
    overrides = dict(options.settings or {}, llm_model_path=options.model)
    parameters = Settings.load(overrides).llm_parameter_values()
    if not parameters["kv_events"]:
        parameters["kv_events"] = kv_events
    elif not binds(parameters["kv_events"]):
        raise ValueError(f"kv_events {parameters['kv_events']!r} connects to a subscriber; a Dynamo worker's "
                         f"stream must bind (tcp://*:PORT or ipc://PATH) for Dynamo's relay to subscribe")
    return parameters


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


async def serve(options: WorkerOptions) -> None:
    """Build the engine, register with Dynamo and serve until SIGINT/SIGTERM (then Dynamo drains and the engine's
    threads stop).

    Raises:
        what create_service raises (bad settings, a folder the engine cannot load); Dynamo's errors when etcd or
        NATS cannot be reached.
    """
    from dynamo.llm import (
        KvEventPublisher,
        ModelInput,
        ModelType,
        WorkerMetricsPublisher,
        WorkerType,
        register_llm,
    )
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, options.discovery_backend, options.request_plane)
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, runtime.shutdown)
    endpoint = runtime.endpoint(f"{options.namespace}.{options.component}.{options.endpoint}")
    with tempfile.TemporaryDirectory(prefix="omni-dynamo-") as folder:
        # the engine publishes on an ipc socket of its own, so workers on one machine never share a port
        parameters = llm_parameters(options, f"ipc://{folder}/kv-events")
        service = await asyncio.to_thread(create_service, parameters)
        service.start()
        with contextlib.ExitStack() as cleanup:  # undone in reverse, whichever step fails: the engine's threads last
            cleanup.callback(service.shutdown)
            kv_publisher = KvEventPublisher(endpoint=endpoint, kv_block_size=service.engine.config.block_size,
                                            zmq_endpoint=service.core.kv_events.endpoint.replace("*", "127.0.0.1"),
                                            zmq_topic=parameters["kv_events_topic"])
            cleanup.callback(kv_publisher.shutdown)
            load = WorkerMetricsPublisher()
            await load.create_endpoint(endpoint)
            cleanup.callback(asyncio.create_task(publish_load(service, load)).cancel)
            await register_llm(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint, options.model,
                               options.served_model_name, worker_type=WorkerType.Aggregated,
                               kv_cache_block_size=service.engine.config.block_size,
                               runtime_config=runtime_config(service))
            bos = service.engine.tokenizer.bos_token_id
            logger.info("serving %s as Dynamo endpoint %s.%s.%s (pid %d)", options.model, options.namespace,
                        options.component, options.endpoint, os.getpid())
            await endpoint.serve_endpoint(Handler(service).generate, graceful_shutdown=True,
                                          health_check_payload=protocol.health_check_payload(
                                              bos if bos is not None else 0))
