"""The llm model's Triton parameters: the engine's settings, the stage's own and the governor's, parsed once.

Every key is a declared setting (omni_backend/settings.py): `EngineConfig`'s fields, `LLMStageSettings`' and
`GovernorConfig`'s under `governor_`. omni_backend/repository.py renders all of them into the llm model's
`config.pbtxt`; a key that none declares is refused, so a misspelt parameter cannot be ignored silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from omni_backend import settings
from omni_backend.engine.config import EngineConfig
from omni_backend.ops.governor import GovernorConfig
from omni_backend.ops.hardware import resolve_device
from omni_backend.settings import SettingGroup, setting


@dataclass
class LLMStageSettings(SettingGroup):
    """Settings of the llm stage around its engine."""

    max_queued_requests: int = setting(256, "requests the llm stage holds beyond max_num_seqs, waiting to run; one "
                                       "more is refused at once with UNAVAILABLE \"waiting queue is full ... retry "
                                       "later\" (the front door: 429 + Retry-After); 0: no limit", low=0)
    kv_events: str = setting("", "publish the prefix cache's KV events as vLLM's ZMQ stream on this endpoint "
                             "(tcp://*:PORT binds, tcp://HOST:PORT connects; engine N of a server over every GPU, "
                             "device cuda or auto: PORT + N); "
                             "empty: off", pattern=r"(tcp://\S+:\d+|(ipc|inproc)://\S+)?",
                             forms="empty, or a ZMQ endpoint tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    kv_events_topic: str = setting("", "the topic frame of every KV-event message (llm-d's indexer reads "
                                   "kv@POD@MODEL); empty: none, as vLLM's default")
    dynamo_endpoint: str = setting("", "also serve this stage's engine as an NVIDIA Dynamo LLM worker at this "
                                   "endpoint, from inside tritonserver (stages/llm/dynamo_endpoint.py; etcd and NATS "
                                   "from ETCD_ENDPOINTS / NATS_SERVER; needs kv_events on an endpoint that binds, "
                                   "e.g. ipc://PATH); empty: off", pattern=r"([\w-]+\.[\w-]+\.[\w-]+)?",
                                   forms="empty, or NAMESPACE.COMPONENT.ENDPOINT")


SETTING_GROUPS: tuple[tuple[type, str], ...] = (
    (EngineConfig, ""), (LLMStageSettings, ""), (GovernorConfig, GovernorConfig.PREFIX))
"""The llm model's parameters: (declaring class, key prefix)."""


@dataclass
class StageParameters:
    """The llm model's parameters, parsed: its engine's config (device resolved for this instance), the stage's
    settings, the governor's thresholds, and the instance's index among the server's llm engines (`place_instance`).
    """

    engine: EngineConfig
    stage: LLMStageSettings
    governor: GovernorConfig
    engine_index: int = 0


def parameter_keys() -> list[str]:
    """Every key the llm model's parameters may hold, in declaration order."""
    return [prefix + f.name for cls, prefix in SETTING_GROUPS for f, _ in settings.declared(cls)]


def parse_parameters(parameters: dict[str, str], instance_kind: str | None = None,
                     instance_device_id: str | int | None = None,
                     resolve: Callable[[str], str] = resolve_device) -> StageParameters:
    """The llm model's string parameters (`triton_glue.string_parameters`) for the instance Triton describes.

    Raises:
        ValueError: a key no setting declares, a malformed value, a device that contradicts the instance
            (`place_instance`), or a `dynamo_endpoint` without `kv_events` that binds.
    """
    unknown = sorted(set(parameters) - set(parameter_keys()))
    if unknown:
        raise ValueError(f"unknown llm parameter(s): {', '.join(unknown)}; known: {', '.join(parameter_keys())}")
    engine = EngineConfig.from_strings(parameters)
    stage = LLMStageSettings.from_strings(parameters)
    if stage.dynamo_endpoint:
        from omni_backend.ops.kv_event_stream import binds  # pyzmq only for those who ask

        if not stage.kv_events or not binds(stage.kv_events):
            raise ValueError(f"dynamo_endpoint needs kv_events on an endpoint that binds (ipc://PATH or "
                             f"tcp://*:PORT) for Dynamo's relay to subscribe to, got {stage.kv_events!r}")
    device, index = place_instance(engine.device, instance_kind, instance_device_id, resolve)
    return StageParameters(dataclasses.replace(engine, device=device), stage,
                           GovernorConfig.from_strings(parameters, GovernorConfig.PREFIX), index)


def place_instance(requested: str, instance_kind: str | None = None, instance_device_id: str | int | None = None,
                   resolve: Callable[[str], str] = resolve_device) -> tuple[str, int]:
    """(device, engine index) of this model instance's engine.

    Triton tells a Python model its instance's kind and device (`args["model_instance_kind"]`,
    `args["model_instance_device_id"]`). A KIND_GPU instance group runs one instance per listed GPU (data
    parallel inside one tritonserver, see repository.llm_instance_group), and each instance's engine takes its
    own GPU. Otherwise the `device` setting decides ("auto", "cpu", "cuda", "cuda:N"), through `resolve`
    (ops.hardware.resolve_device, which warns when NVML sees a GPU that torch cannot use and fails loudly for an
    explicit CUDA device torch cannot use).

    The engine index is the instance's place among the server's llm engines: the label `engine` of its standard
    metrics, its KV events' data-parallel rank and port offset (ops/kv_event_stream.py). Only a KIND_GPU group over
    every GPU (`device` cuda or auto) runs several engines, one per GPU, numbered as Triton numbers the GPUs it
    sees (0 .. n-1): the index is the GPU's. Every other server runs one engine, index 0: a CPU, tensor parallel
    (one KIND_MODEL instance) and `device` cuda:N (a group of GPU N alone: `OMNI_DEVICE=cuda:2` publishes on the
    kv_events port itself, engine "0").

    Raises:
        ValueError: the device setting contradicts a KIND_GPU instance; what `resolve` raises.
    """
    if instance_kind != "GPU":
        return resolve(requested), 0
    gpu = int(instance_device_id or 0)
    device = f"cuda:{gpu}"
    if requested == "cpu" or (requested.startswith("cuda:") and requested != device):
        raise ValueError(f"device {requested!r} contradicts this KIND_GPU instance on {device}")
    return resolve(device), 0 if requested.startswith("cuda:") else gpu
