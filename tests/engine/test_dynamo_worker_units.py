"""The Dynamo worker's request/response mapping (stages/llm/dynamo_protocol.py) and its asyncio stream over the llm
service (stages/llm/async_sink.py), without Dynamo: no etcd, NATS or ai-dynamo package needed."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import types
from types import SimpleNamespace

import pytest

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine, RequestOutput
from omni_backend.engine.sampling_params import InvalidSamplingParam, SamplingParams
from omni_backend.repository import Settings
from omni_backend.stages.llm import dynamo_protocol as protocol
from omni_backend.stages.llm.async_sink import AsyncSink
from omni_backend.stages.llm.parameters import parse_parameters
from omni_backend.stages.llm.service import LLMService
from omni_backend.vocabulary import ErrorKind, StageError

# A preprocessed request as Dynamo 1.6's frontend sends it for a chat completion (keys of PreprocessedRequest)
DYNAMO_REQUEST = {
    "model": "smollm2", "token_ids": [1, 9690, 198, 2683], "eos_token_ids": [2],
    "stop_conditions": {"max_tokens": 32, "stop": ["\n\n"], "stop_token_ids_hidden": [7], "min_tokens": None,
                        "ignore_eos": None, "max_thinking_tokens": None},
    "sampling_options": {"n": None, "temperature": 0.7, "top_p": 0.9, "top_k": None, "min_p": None, "seed": 42,
                         "presence_penalty": 0.5, "frequency_penalty": None, "repetition_penalty": None,
                         "guided_decoding": None, "use_beam_search": None},
    "output_options": {"logprobs": None, "prompt_logprobs": None, "skip_special_tokens": None},
    "annotations": [], "mdc_sum": "abc",
}


def test_a_chat_request_maps_to_our_sampling_params():
    params = protocol.sampling_params(DYNAMO_REQUEST, max_model_len=2048)
    assert protocol.prompt_token_ids(DYNAMO_REQUEST) == [1, 9690, 198, 2683]
    assert params == SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=42, presence_penalty=0.5,
                                    stop_token_ids=[7, 2], stream=True)  # stop strings stay with the frontend


def test_without_max_tokens_a_request_may_fill_the_context_and_ignore_eos_drops_the_eos_ids():
    request = {"token_ids": [5, 6, 7], "eos_token_ids": [2], "stop_conditions": {"ignore_eos": True}}
    params = protocol.sampling_params(request, max_model_len=100)
    assert (params.max_tokens, params.ignore_eos, params.stop_token_ids) == (97, True, [])
    assert params.temperature == 1.0  # our default, as OpenAI's


@pytest.mark.parametrize("request_update, message", [
    ({"token_ids": []}, "token_ids must be a non-empty list of integers"),
    ({"token_ids": [1, "2"]}, "token_ids must be a non-empty list of integers"),
    ({"sampling_options": {"n": 2}}, "sampling_options.n must be 1 on this worker, got 2"),
    ({"sampling_options": {"guided_decoding": {"json": {}}}}, "sampling_options.guided_decoding is not supported"),
    ({"output_options": {"logprobs": 2}}, "output_options.logprobs is not supported"),
    ({"stop_conditions": {"min_tokens": 4}}, "stop_conditions.min_tokens is not supported"),
    ({"stop_conditions": "max_tokens=3"}, "stop_conditions must be an object, got str"),
])
def test_what_the_worker_does_not_do_is_refused_naming_the_field(request_update, message):
    with pytest.raises(ValueError, match=message):
        protocol.sampling_params({**DYNAMO_REQUEST, **request_update}, max_model_len=2048)


def test_a_bad_value_is_refused_by_our_sampling_params_as_a_client_error():
    with pytest.raises(InvalidSamplingParam, match="top_p") as error:
        protocol.sampling_params({**DYNAMO_REQUEST, "sampling_options": {"top_p": 1.5}}, max_model_len=2048)
    assert StageError.of(error.value, "llm").kind is ErrorKind.INVALID_ARGUMENT  # the worker's HTTP 400


def test_outputs_map_to_dynamo_chunks_with_usage_on_the_last():
    middle = RequestOutput("r", "Par", [3, 4], None, prompt_tokens=40, completion_tokens=2)
    last = RequestOutput("r", "is.", [5], "stop", prompt_tokens=40, completion_tokens=4, cached_tokens=32)
    assert protocol.chunk(middle) == {"token_ids": [3, 4], "index": 0}
    assert protocol.chunk(last) == {
        "token_ids": [5], "index": 0, "finish_reason": "stop",
        "completion_usage": {"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44,
                             "prompt_tokens_details": {"cached_tokens": 32}}}
    assert protocol.health_check_payload(1)["token_ids"] == [1]


def test_the_worker_reads_the_llm_stages_settings():
    parameters = Settings.load({"max_model_len": 512}, environ={}).llm_parameter_values()
    parsed = parse_parameters(parameters)
    assert parsed.engine.max_model_len == 512 and parsed.stage.kv_events == ""


def test_the_worker_publishes_its_kv_events_on_a_socket_dynamo_can_subscribe_to(monkeypatch):
    """worker.py without the Dynamo packages: only `serve` and the error mapping import them."""
    from omni_backend.launch.dynamo.worker import WorkerOptions, llm_parameters

    monkeypatch.delenv("OMNI_KV_EVENTS", raising=False)
    options = WorkerOptions("/models/m", settings={"max_model_len": "512"})
    parameters = llm_parameters(options, "ipc:///tmp/w/kv-events")
    assert (parameters["model_path"], parameters["max_model_len"]) == ("/models/m", "512")
    assert parameters["kv_events"] == "ipc:///tmp/w/kv-events"
    options.settings["kv_events"] = "tcp://*:5557"
    assert llm_parameters(options, "ipc:///tmp/w/kv-events")["kv_events"] == "tcp://*:5557"
    options.settings["kv_events"] = "tcp://indexer:5557"
    with pytest.raises(ValueError, match="must bind"):
        llm_parameters(options, "ipc:///tmp/w/kv-events")


def test_an_async_stream_yields_the_engines_tokens_then_ends(service, tiny_qwen2_path):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stream=True)
    expected = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=64,
                                      max_model_len=512)).generate([[11, 12, 13]], params)[0]

    async def read() -> list[RequestOutput]:
        sink = AsyncSink(asyncio.get_running_loop())
        service.submit("a", [11, 12, 13], params, sink)
        return [output async for output in sink]

    outputs = asyncio.run(asyncio.wait_for(read(), 60))
    assert [t for o in outputs for t in o.token_ids] == expected.token_ids
    assert [o.finish_reason for o in outputs][-1] == "length" and sum(o.finished for o in outputs) == 1


def test_a_reader_that_stops_aborts_the_request_in_the_engine(smollm2_path):
    """What the worker does when Dynamo stops a request's context: the engine drops it and frees its blocks.
    SmolLM2, not the tiny model: 400 tokens take it seconds, so the request is still running when it stops."""
    service = LLMService(LLMEngine(EngineConfig(model_path=smollm2_path, dtype="float32", num_kv_blocks=64,
                                                max_model_len=512)))
    service.start()
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, stream=True)
    free_before = service.engine.runner.block_manager.num_free_blocks

    async def read_one_then_stop() -> list:
        stopped = []
        sink = AsyncSink(asyncio.get_running_loop(), lambda: bool(stopped))
        service.submit("b", [21, 22, 23], params, sink)
        first = await sink.__anext__()
        stopped.append(True)  # as context.is_stopped() turning True
        return [first, *[output async for output in sink]]

    try:
        outputs = asyncio.run(asyncio.wait_for(read_one_then_stop(), 60))
        assert not any(o.finished for o in outputs) and sum(len(o.token_ids) for o in outputs) < 400
        assert service.num_active == 0
        deadline = time.monotonic() + 30  # the abort reaches the engine at its loop's next iteration
        while service.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not service.engine.has_unfinished()
        assert service.engine.runner.block_manager.num_free_blocks == free_before
    finally:
        service.shutdown()


def test_a_request_the_service_fails_raises_its_error():
    async def read() -> None:
        sink = AsyncSink(asyncio.get_running_loop())
        sink.fail(StageError(ErrorKind.INTERNAL, "llm failed: boom"))
        async for _ in sink:
            pass

    with pytest.raises(StageError, match="boom"):
        asyncio.run(read())


# --- dynamo_endpoint.py's Dynamo calls (the worker's and the Triton stage's), over fake `dynamo.llm` / `dynamo.runtime` modules -----------------------------------


class _HttpError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(code, message)
        self.code = code


class _FakeService:
    def __init__(self, calls: list[str], fail_with: StageError | None = None):
        self.calls, self.fail_with = calls, fail_with
        self.engine = SimpleNamespace(max_model_len=64, config=SimpleNamespace(block_size=16, model_path="/models/m"),
                                      tokenizer=SimpleNamespace(bos_token_id=1),
                                      runner=SimpleNamespace(block_manager=SimpleNamespace(num_blocks=8,
                                                                                           num_free_blocks=8)))
        self.core = SimpleNamespace(kv_events=SimpleNamespace(endpoint="ipc:///tmp/fake-kv-events"))

    def start(self) -> None:
        self.calls.append("service started")

    def shutdown(self) -> None:
        self.calls.append("service shut down")

    def submit(self, request_id, prompt_token_ids, params, sink) -> None:
        sink.fail(self.fail_with)  # as the engine loop does when the step fails the request


def _fake_dynamo(monkeypatch, calls: list[str], failing: str) -> None:
    """Install fake Dynamo modules whose step `failing` ("kv publisher", "load endpoint" or "register") raises."""

    def step(name: str) -> None:
        if name == failing:
            raise RuntimeError(f"{name}: NATS unreachable")
        calls.append(name)

    class KvEventPublisher:
        def __init__(self, **kwargs):
            step("kv publisher")

        def shutdown(self) -> None:
            calls.append("kv publisher shut down")

    class WorkerMetricsPublisher:
        async def create_endpoint(self, endpoint) -> None:
            step("load endpoint")

        def publish(self, *args, **kwargs) -> None:
            pass

    async def register_llm(model_input, model_type, endpoint, model, *args, **kwargs) -> None:
        step("register")
        calls.append(f"registered {model} at {endpoint.path}")

    class DistributedRuntime:
        """Serves an endpoint until `shutdown`, as Dynamo's does."""

        def __init__(self, loop, *args):
            self.stopped = asyncio.Event()

        def shutdown(self) -> None:
            calls.append("runtime shut down")
            self.stopped.set()

        def endpoint(self, path: str):
            async def serve_endpoint(handler, **kwargs) -> None:
                calls.append(f"serving {path}")
                await self.stopped.wait()
                calls.append("drained")

            return SimpleNamespace(path=path, serve_endpoint=serve_endpoint)

    flags = SimpleNamespace(Tokens=1, Chat=1, Completions=2, Aggregated=0)
    llm = types.ModuleType("dynamo.llm")
    llm.__dict__.update(HttpError=_HttpError, KvEventPublisher=KvEventPublisher, ModelInput=flags, ModelType=flags,
                        WorkerMetricsPublisher=WorkerMetricsPublisher, WorkerType=flags, register_llm=register_llm)
    runtime = types.ModuleType("dynamo.runtime")
    runtime.DistributedRuntime = DistributedRuntime
    monkeypatch.setitem(sys.modules, "dynamo", types.ModuleType("dynamo"))
    monkeypatch.setitem(sys.modules, "dynamo.llm", llm)
    monkeypatch.setitem(sys.modules, "dynamo.runtime", runtime)


@pytest.mark.parametrize("failing, undone", [
    ("kv publisher", ["service shut down"]),
    ("load endpoint", ["kv publisher shut down", "service shut down"]),
    ("register", ["kv publisher shut down", "service shut down"]),
])
def test_a_dynamo_step_that_fails_after_the_engine_started_still_shuts_the_engine_down(monkeypatch, failing, undone):
    from omni_backend.launch.dynamo import worker
    from omni_backend.stages.llm import dynamo_endpoint

    calls: list[str] = []
    _fake_dynamo(monkeypatch, calls, failing)
    monkeypatch.setattr(worker, "llm_parameters", lambda options, kv_events: {"kv_events_topic": ""})
    monkeypatch.setattr(worker, "create_service", lambda parameters: _FakeService(calls))
    monkeypatch.setattr(dynamo_endpoint, "runtime_config", lambda service: None)
    with pytest.raises(RuntimeError, match=f"{failing}: NATS unreachable"):
        asyncio.run(worker.serve(worker.WorkerOptions("/models/m")))
    assert calls[-len(undone):] == undone, calls


def test_a_request_the_engine_fails_is_an_http_error_and_not_logged_as_ended_by_its_caller(monkeypatch, caplog):
    from omni_backend.stages.llm.dynamo_endpoint import Handler

    _fake_dynamo(monkeypatch, [], failing="")
    handler = Handler(_FakeService([], fail_with=StageError(ErrorKind.INTERNAL, "llm failed: boom")))
    context = SimpleNamespace(is_stopped=lambda: False, is_killed=lambda: False, id=lambda: "ctx-1")

    async def read() -> None:
        async for _ in handler.generate(DYNAMO_REQUEST, context):
            pass

    with caplog.at_level(logging.INFO), pytest.raises(_HttpError, match="boom") as error:
        asyncio.run(read())
    assert error.value.code == 500
    assert "ended by its caller" not in caplog.text


def test_the_llm_stage_serves_its_own_service_on_dynamo_and_stops_it_in_finalize(monkeypatch):
    """model_repository/llm's glue: with `dynamo_endpoint` the stage's running service is registered from a daemon
    thread (the same serve_service as the worker's); its stop shuts Dynamo's runtime down, which drains, and the
    KV-event relay is shut before the stage stops its engine."""
    from omni_backend.stages.llm import dynamo_endpoint

    calls: list[str] = []
    _fake_dynamo(monkeypatch, calls, failing="")
    monkeypatch.setattr(dynamo_endpoint, "runtime_config", lambda service: None)
    service = _FakeService(calls)
    assert dynamo_endpoint.serve_stage_on_dynamo(service, {"kv_events": "ipc:///tmp/fake-kv-events"}) is None
    dynamo = dynamo_endpoint.serve_stage_on_dynamo(service, {"dynamo_endpoint": "omni.llm.generate",
                                                             "kv_events": "ipc:///tmp/fake-kv-events"})
    deadline = time.monotonic() + 30
    while "serving omni.llm.generate" not in calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls == ["kv publisher", "load endpoint", "register", "registered /models/m at omni.llm.generate",
                     "serving omni.llm.generate"]
    dynamo.stop()
    assert calls[5:] == ["runtime shut down", "drained", "kv publisher shut down"]
    assert not dynamo._thread.is_alive()


def test_a_stage_dynamo_endpoint_needs_kv_events_that_bind():
    with pytest.raises(ValueError, match="dynamo_endpoint needs kv_events on an endpoint that binds"):
        parse_parameters({"model_path": "/models/m", "dynamo_endpoint": "omni.llm.generate",
                          "kv_events": "tcp://indexer:5557"})
    with pytest.raises(ValueError, match="dynamo_endpoint"):
        parse_parameters({"model_path": "/models/m", "dynamo_endpoint": "omni-llm"})


def test_outputs_that_wait_for_the_reader_come_as_one_delta_with_every_token_in_order():
    """A reader that fell behind gets what accumulated in one output (one Dynamo message, not one per token), the
    final one's finish reason and counts included; an error after outputs is raised once they are read."""
    async def read() -> tuple[list[RequestOutput], list[RequestOutput]]:
        sink = AsyncSink(asyncio.get_running_loop())
        sink.send(RequestOutput("r", "a", [3], None, prompt_tokens=5, completion_tokens=1))
        sink.send(RequestOutput("r", "b", [4, 5], None, prompt_tokens=5, completion_tokens=3))
        sink.send(RequestOutput("r", "c", [6], "length", prompt_tokens=5, completion_tokens=4, cached_tokens=2))
        joined = [output async for output in sink]
        failing = AsyncSink(asyncio.get_running_loop())
        failing.send(RequestOutput("s", "x", [7], None, prompt_tokens=1, completion_tokens=1))
        failing.send(RequestOutput("s", "y", [8], None, prompt_tokens=1, completion_tokens=2))
        failing.fail(StageError(ErrorKind.INTERNAL, "llm failed: late"))
        before_error = []
        with pytest.raises(StageError, match="late"):
            async for output in failing:
                before_error.append(output)
        return joined, before_error

    joined, before_error = asyncio.run(read())
    assert [(o.token_ids, o.text, o.finish_reason, o.completion_tokens, o.cached_tokens) for o in joined] == [
        ([3, 4, 5, 6], "abc", "length", 4, 2)]
    assert [(o.token_ids, o.finished) for o in before_error] == [([7, 8], False)]


def test_a_reader_waiting_while_outputs_arrive_from_another_thread_gets_every_token_in_order():
    """The wake-up handshake: no output sent while the reader waits or reads is lost (a lost wake-up hangs)."""
    import threading

    async def read() -> list[int]:
        sink = AsyncSink(asyncio.get_running_loop())

        def produce():
            for i in range(50):
                sink.send(RequestOutput("r", str(i), [i], None, prompt_tokens=1, completion_tokens=i + 1))
                time.sleep(0.001)
            sink.send(RequestOutput("r", "", [50], "length", prompt_tokens=1, completion_tokens=51))

        thread = threading.Thread(target=produce)
        thread.start()
        tokens = [t async for output in sink for t in output.token_ids]
        thread.join()
        return tokens

    assert asyncio.run(asyncio.wait_for(read(), 30)) == list(range(51))
