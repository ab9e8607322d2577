"""Our LLM engine as an NVIDIA Dynamo LLM worker of its own (ai-dynamo-runtime 1.6), without Triton.

The worker builds the llm stage's service (`stages.llm.build.create_service`: engine, engine-loop and response
threads) from the same settings as the Triton llm stage (`OMNI_<NAME>`, `repository.Settings`), its KV events on an
ipc socket of its own unless `kv_events` names one that binds, and serves it with
`stages.llm.dynamo_endpoint.serve_service` (registration, generate endpoint, KV-event relay, load metrics) until
SIGINT/SIGTERM; the Triton llm stage serves its own service the same way with the `dynamo_endpoint` setting.
Health: Dynamo's own system server (`DYN_SYSTEM_ENABLED=true`, `DYN_SYSTEM_PORT`: `/health`, `/live`).

Discovery and events come from Dynamo's environment: `ETCD_ENDPOINTS`, `NATS_SERVER` (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
from dataclasses import dataclass

from omni_backend.ops.kv_event_stream import binds
from omni_backend.repository import Settings
from omni_backend.stages.llm.build import create_service
from omni_backend.stages.llm.dynamo_endpoint import serve_service


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


async def serve(options: WorkerOptions) -> None:
    """Build the engine, register with Dynamo and serve until SIGINT/SIGTERM (then Dynamo drains and the engine's
    threads stop).

    Raises:
        what create_service raises (bad settings, a folder the engine cannot load); Dynamo's errors when etcd or
        NATS cannot be reached.
    """
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, options.discovery_backend, options.request_plane)
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, runtime.shutdown)
    with tempfile.TemporaryDirectory(prefix="omni-dynamo-") as folder:
        # the engine publishes on an ipc socket of its own, so workers on one machine never share a port
        parameters = llm_parameters(options, f"ipc://{folder}/kv-events")
        service = await asyncio.to_thread(create_service, parameters)
        service.start()
        try:
            await serve_service(service, runtime, f"{options.namespace}.{options.component}.{options.endpoint}",
                                options.served_model_name, parameters["kv_events_topic"])
        finally:  # the engine's threads last, after Dynamo drained
            service.shutdown()
