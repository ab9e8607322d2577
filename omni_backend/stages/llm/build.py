"""Building the llm stage's service from its Triton parameters: engine, governor, metrics, probes."""

from __future__ import annotations

import threading

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.ops.governor import Governor
from omni_backend.ops.gpu_budget import apply_gpu_memory_budget
from omni_backend.ops.hardware import cpu_engine_threads, runtime_versions
from omni_backend.ops.metrics import LLMMetrics
from omni_backend.stages.llm.cancel_board import CancelBoard, shared_folder
from omni_backend.stages.llm.parameters import StageParameters, parse_parameters
from omni_backend.stages.llm.server_probe import parent_operator_key, parent_server_probe
from omni_backend.stages.llm.service import LLMService
from omni_backend.stages.llm.stop_watch import STOP_MARGIN_S


def build_engine_on_a_passing_thread(config: EngineConfig) -> LLMEngine:
    """`LLMEngine(config)`, built on a thread that exits once it is done, so that afterwards only the engine-loop
    thread runs torch's parallel CPU regions.

    Why: torch's CPU kernels parallelise with OpenMP (libgomp), which keeps a pool of worker threads for every
    thread that ever entered a parallel region, until that thread exits. Loading the weights on the stub's main
    thread would leave its pool beside the engine loop's; with more pool threads than cores libgomp stops
    spinning between regions ("throttled" spin, GOMP_SPINCOUNT in the libgomp manual), so every parallel op
    then pays a futex wake-up. Measured on this project's 2-core CPU machine: a parallel elementwise op
    33 -> 210 us, and the llm stage at 217 instead of 386 output tok/s for bench_engine's workload.

    Raises:
        what LLMEngine raises (re-raised here).
    """
    built: list = []

    def build() -> None:
        try:
            built.append(LLMEngine(config))
        except BaseException as exc:  # handed to the caller's thread
            built.append(exc)

    thread = threading.Thread(target=build, name="llm-engine-build")
    thread.start()
    thread.join()
    if isinstance(built[0], BaseException):
        raise built[0]
    return built[0]


def create_service(parameters: dict[str, str], pb_utils=None, model: str = "llm", version: str = "1",
                   metrics_interval_s: float = 1.0, instance_kind: str | None = None,
                   instance_device_id: str | int | None = None) -> LLMService:
    """Engine, governor and (with `pb_utils`) metrics from the llm model's string parameters
    (`parameters.parse_parameters`), for the model instance Triton describes; not started.

    On a GPU the process is first capped at `gpu_memory_utilization` of the device (ops/gpu_budget.py), the share
    the engine sizes its KV cache in. A CPU engine gets `cpu_threads` torch threads, 0 meaning the usable cores
    minus one (`ops.hardware.cpu_engine_threads`). With `pb_utils` (in a stub process) the operator's key for
    prefix cache resets and the stop probe are the parent tritonserver's (`server_probe`), and cancels by key are
    shared with the server's other llm instances (`cancel_board`). With the `kv_events` setting the prefix cache's
    events go out on that ZMQ endpoint (ops/kv_event_stream.py), data-parallel rank = the engine's index among the
    server's llm engines (`parameters.place_instance`).

    Raises:
        ValueError: malformed parameters; RuntimeError: a CUDA device torch cannot use; what LLMEngine raises;
            zmq.ZMQError: a `kv_events` endpoint that cannot be bound or connected.
    """
    parsed = parse_parameters(parameters, instance_kind, instance_device_id)
    config = parsed.engine
    if config.torch_device.type == "cpu":  # a server process: leave a core to tritonserver and the front door
        config.cpu_threads = cpu_engine_threads(config.cpu_threads)
    apply_gpu_memory_budget(config.device, config.gpu_memory_utilization, model)
    engine = build_engine_on_a_passing_thread(config)
    try:  # from here on a failure must not leave the engine's tensor-parallel ranks running
        return _wrap(engine, parsed, pb_utils, model, version, metrics_interval_s)
    except BaseException:
        engine.close()
        raise


def _wrap(engine: LLMEngine, parsed: StageParameters, pb_utils, model: str, version: str,
          metrics_interval_s: float) -> LLMService:
    """`create_service`'s service around its built engine (governor, metrics, probes, KV-event stream)."""
    config = engine.config
    governor = Governor.for_device(config.torch_device, config.max_num_seqs, parsed.governor)
    engine_index = parsed.engine_index
    metrics = None
    if pb_utils is not None:
        runner = engine.runner
        versions = runtime_versions()
        info = {key: versions[key] for key in ("torch", "cuda_runtime", "cuda_driver", "triton")}
        info.update(attention_backend=runner.attention_backend, attention_reason=runner.attention_reason,
                    matmuls=runner.matmuls, matmul_kernel=runner.matmul_kernel,
                    fallback_reason=runner.fallback_reason, dtype=str(runner.dtype).removeprefix("torch."),
                    dtype_reason=runner.dtype_reason)
        metrics = LLMMetrics(pb_utils, model, version, runner.attention_backend, str(runner.device.torch_device),
                             info, engine_index)
    probe, exit_timeout_s = parent_server_probe() if pb_utils is not None else (None, None)
    stop_grace_s = max(0.0, exit_timeout_s - STOP_MARGIN_S) if exit_timeout_s is not None else None
    operator_key = parent_operator_key() if pb_utils is not None else None
    board = CancelBoard(shared_folder()) if pb_utils is not None else None
    kv_events = None
    if parsed.stage.kv_events:  # imports pyzmq and msgpack only for those who ask
        from omni_backend.ops.kv_event_stream import KVEventStream

        kv_events = KVEventStream(parsed.stage.kv_events, parsed.stage.kv_events_topic, engine_index)
    return LLMService(engine, governor, metrics, metrics_interval_s, parsed.stage.max_queued_requests, probe,
                      stop_grace_s, operator_key, board, kv_events)
