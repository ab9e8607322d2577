"""The llm stage's threads: concurrent requests, cancellation via is_cancelled, errors as responses."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from helpers.list_sink import ListSink

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.operator_key import ADMIN_KEY_HEADER, admin_key_of, restricted_api_flags, tritonserver_flags
from omni_backend.stages.llm.build import build_engine_on_a_passing_thread
from omni_backend.stages.llm.parameters import engine_index, instance_device, parse_parameters
from omni_backend.stages.llm.server_probe import parent_operator_key, parent_server_probe
from omni_backend.stages.llm.service import LOOP_STUCK_AFTER_S, LLMService, QueueFull
from omni_backend.stages.llm.triton_io import cancel_key, generation_inputs, is_reset_request, output_arrays
from omni_backend.vocabulary import ErrorKind, FieldError, StageError


def _streams_equal_offline(service, model_path, prompts, params, sink_type=ListSink) -> list:
    """Submit `prompts` to the running service, one sink each; assert every stream joins to the offline engine's
    greedy result with one final output. Returns the sinks."""
    offline = LLMEngine(EngineConfig(model_path=model_path, dtype="float32", num_kv_blocks=64,
                                     max_model_len=512)).generate(prompts, params)
    sinks = [sink_type() for _ in prompts]
    for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
        service.submit(f"{sink_type.__name__}{i}", prompt, params, sink)
    for sink, expected in zip(sinks, offline):
        assert sink.done.wait(30)
        assert [t for o in sink.outputs for t in o.token_ids] == expected.token_ids
        assert "".join(o.text for o in sink.outputs) == expected.text
        assert sum(o.finished for o in sink.outputs) == 1 and sink.outputs[-1].finish_reason == "length"
    return sinks


def test_concurrent_streams_equal_offline_results(service, tiny_qwen2_path):
    prompts = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(6)]
    _streams_equal_offline(service, tiny_qwen2_path, prompts,
                           SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stream=True))


def test_a_slow_sender_gets_the_same_stream_in_fewer_larger_chunks(service, tiny_qwen2_path):
    """While one response is being sent, the engine's next outputs of that request are joined into one."""

    class SlowSink(ListSink):
        def send(self, output):
            time.sleep(0.05)  # an IPC round trip under load
            super().send(output)

    prompts = [[100 + i, 200 + i, 300 + i] for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stream=True, logprobs=1)
    sinks = _streams_equal_offline(service, tiny_qwen2_path, prompts, params, SlowSink)
    for sink in sinks:
        assert [lp.token_id for o in sink.outputs for lp in o.logprobs] == [t for o in sink.outputs
                                                                            for t in o.token_ids]
        assert [o.completion_tokens for o in sink.outputs] == [
            sum(len(o.token_ids) for o in sink.outputs[:i + 1]) for i in range(len(sink.outputs))]
    assert sum(len(sink.outputs) for sink in sinks) < 4 * 24  # some deltas carried several tokens


def test_a_failed_send_aborts_the_request_and_ends_its_stream(service):
    class BrokenSink(ListSink):
        def send(self, output):
            raise RuntimeError("the client is gone")

    sink = BrokenSink()
    service.submit("broken", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True, stream=True), sink)
    assert sink.done.wait(10)
    assert sink.closed == 1 and sink.outputs == [] and sink.errors == []
    deadline = time.monotonic() + 10
    while (service.num_active or service.engine.runner.block_manager.num_free_blocks != 64) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.num_active == 0 and service.engine.runner.block_manager.num_free_blocks == 64


def test_cancellation_frees_blocks_and_ends_the_stream(service):
    sink = ListSink()
    service.submit("long", [5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True, stream=True), sink)
    deadline = time.monotonic() + 10
    while not sink.outputs and time.monotonic() < deadline:
        time.sleep(0.01)
    sink.cancelled = True
    assert sink.done.wait(5)  # the stream ends with the final flag alone (python_backend's contract)
    sent = len(sink.outputs)
    time.sleep(0.3)
    assert sink.closed == 1 and len(sink.outputs) == sent and not sink.errors  # nothing after the final flag
    assert "long" not in service.engine.requests  # aborted, not run to its 500 tokens
    assert "long" not in service.router.held()
    assert sink.outputs[-1].completion_tokens < 500
    deadline = time.monotonic() + 5
    while service.engine.runner.block_manager.num_free_blocks != 64 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.engine.runner.block_manager.num_free_blocks == 64
    assert service.num_active == 0


def test_a_cancel_by_key_ends_the_stream_as_a_client_cancel_does(service):
    """`cancel(request_id)` (the llm model's `cancel` input, with the `stream_key` it was sent with) aborts the
    request, frees its blocks and ends its stream with the final flag alone; an unknown key changes nothing."""
    sink, other = ListSink(), ListSink()
    service.submit("key-1", [5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True, stream=True), sink)
    service.submit("key-2", [5, 6, 8], SamplingParams(max_tokens=20, ignore_eos=True, stream=True), other)
    deadline = time.monotonic() + 10
    while not sink.outputs and time.monotonic() < deadline:
        time.sleep(0.01)
    service.cancel("no-such-key")
    service.cancel("key-1")
    assert sink.done.wait(5)
    sent = len(sink.outputs)
    time.sleep(0.3)
    assert sink.closed == 1 and len(sink.outputs) == sent and not sink.errors
    assert sink.outputs[-1].completion_tokens < 500 and "key-1" not in service.engine.requests
    assert other.done.wait(10) and other.outputs[-1].completion_tokens == 20 and not other.closed
    service.cancel("key-1")  # already ended: nothing happens
    deadline = time.monotonic() + 5
    while service.engine.runner.block_manager.num_free_blocks != 64 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.engine.runner.block_manager.num_free_blocks == 64 and service.num_active == 0 and sink.closed == 1


def test_cancel_requests_are_told_apart_by_their_input():
    key = np.array([b"omni_chat-0123"], dtype=np.object_)
    assert cancel_key({"cancel": key}) == "omni_chat-0123"
    assert cancel_key({"input_ids": np.array([1], dtype=np.int32), "stream_key": key}) is None
    with pytest.raises(FieldError, match="^cancel is a request of its own: send it without input_ids"):
        cancel_key({"cancel": key, "input_ids": np.array([1], dtype=np.int32)})


def test_invalid_requests_raise_before_queueing_and_the_next_works(service):
    with pytest.raises(ValueError, match="maximum context length"):
        service.submit("too-long", [1] * 500, SamplingParams(max_tokens=100), ListSink())
    sink = ListSink()
    service.submit("ok", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), sink)
    assert sink.done.wait(10) and sink.outputs[-1].completion_tokens == 3


def test_the_engine_built_on_a_passing_thread_is_the_engine_and_its_errors_reach_the_caller(tiny_qwen2_path,
                                                                                           tmp_path):
    config = EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=64, max_model_len=512)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    built = build_engine_on_a_passing_thread(config)
    assert built.generate([[100, 200, 300]], params)[0].token_ids == \
        LLMEngine(config).generate([[100, 200, 300]], params)[0].token_ids
    missing = EngineConfig(model_path=str(tmp_path / "no-such-model"), dtype="float32", num_kv_blocks=64)
    with pytest.raises(Exception) as direct:
        LLMEngine(missing)
    with pytest.raises(direct.type, match=str(tmp_path)):
        build_engine_on_a_passing_thread(missing)


def test_engine_config_from_triton_parameters(tiny_qwen2_path):
    config = parse_parameters({
        "model_path": tiny_qwen2_path, "device": "auto", "dtype": "float32", "block_size": "32",
        "kv_cache_bytes": "1048576", "max_num_seqs": "4", "max_num_batched_tokens": "64",
        "max_model_len": "256", "attention_backend": "auto", "gpu_memory_utilization": "0.5",
        "enforce_eager": "true", "cpu_threads": "3", "enable_prefix_caching": "false"},
        instance_kind="GPU", instance_device_id="1", resolve=lambda device: device).engine
    assert (config.device, config.block_size, config.kv_cache_bytes, config.max_num_seqs, config.max_model_len,
            config.gpu_memory_utilization, config.enforce_eager, config.cpu_threads,
            config.enable_prefix_caching) == ("cuda:1", 32, 1048576, 4, 256, 0.5, True, 3, False)
    default = parse_parameters({"model_path": "x", "kv_cache_bytes": "0", "cpu_threads": "0"}).engine
    assert default.kv_cache_bytes == 0  # 0: the device's default (engine/memory.py)
    assert default.cpu_threads == 0  # 0: automatic (ops.hardware.cpu_engine_threads)
    assert default.device == "cpu"  # auto, resolved on this machine without CUDA
    assert default.enable_prefix_caching and default.quantization == "none"
    assert parse_parameters({"model_path": "x", "quantization": "int8"}).engine.quantization == "int8"
    for bad, message in (({"block_size": "sixteen"}, "setting block_size must be one of 8, 16, 32, 64, 128, got "
                                                     "'sixteen'"),
                         ({"cpu_threads": "-1"}, "setting cpu_threads must be an integer >= 0, got '-1'"),
                         ({"quantization": "int4"}, "setting quantization must be one of none, int8, got 'int4'"),
                         ({"quantization": "int8", "dtype": "bfloat16"}, "dtype bfloat16 is not that"),
                         ({"enable_prefix_caching": "yes"}, "setting enable_prefix_caching must be true or false"),
                         ({"max_num_seq": "4"}, "unknown llm parameter\\(s\\): max_num_seq; known: model_path")):
        with pytest.raises(ValueError, match=message):
            parse_parameters({"model_path": "x", **bad})


def test_each_kind_gpu_instance_takes_its_own_gpu():
    """Triton's KIND_GPU instance group starts one llm instance per GPU and passes each its device id; the
    engine device follows it (the CUDA check itself is injected: this machine has no GPU)."""
    resolved = []

    def resolve(device):
        resolved.append(device)
        return device

    assert instance_device("auto", "GPU", "1", resolve) == "cuda:1"
    assert instance_device("cuda", "GPU", 0, resolve) == "cuda:0"
    assert instance_device("cuda:1", "GPU", "1", resolve) == "cuda:1"
    assert resolved == ["cuda:1", "cuda:0", "cuda:1"]  # every GPU instance is checked for a usable CUDA torch
    assert instance_device("auto", "CPU", "0", resolve) == "auto"  # a CPU instance: the device parameter decides
    for requested in ("cpu", "cuda:0"):
        with pytest.raises(ValueError, match="contradicts this KIND_GPU instance on cuda:1"):
            instance_device(requested, "GPU", "1", resolve)


def test_the_engine_index_is_the_instances_place_among_the_servers_llm_engines():
    """A group over every GPU (device cuda or auto) numbers its engines by GPU; one engine is 0 wherever it runs:
    OMNI_DEVICE=cuda:2 is engine "0" on the kv_events port itself, not engine 2 on port + 2."""
    assert [engine_index(device, "GPU", gpu) for device, gpu in (("cuda", 0), ("cuda", "1"), ("auto", "3"))] == \
        [0, 1, 3]
    assert engine_index("cuda:2", "GPU", "2") == 0
    assert engine_index("cpu", "CPU", 0) == engine_index("cuda:1", "MODEL", 0) == engine_index("auto") == 0
    parsed = parse_parameters({"model_path": "x", "device": "cuda:2"}, "GPU", "2", resolve=lambda device: device)
    assert (parsed.engine.device, parsed.engine_index) == ("cuda:2", 0)
    assert parse_parameters({"model_path": "x", "device": "cuda"}, "GPU", "1",
                            resolve=lambda device: device).engine_index == 1


def test_out_of_vocabulary_ids_are_refused_and_the_stage_keeps_serving(service):
    vocab = service.engine.runner.model.embed_tokens.num_embeddings
    for bad in ([1, vocab], [-1, 2]):
        with pytest.raises(ValueError, match="token ids must be in"):
            service.submit(f"bad{bad[-1]}", bad, SamplingParams(max_tokens=2), ListSink())
    sink = ListSink()
    service.submit("fine", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), sink)
    assert sink.done.wait(10) and sink.outputs[-1].completion_tokens == 2


def test_the_engine_loop_survives_a_failing_iteration(service, monkeypatch):
    calls = {"n": 0}
    real_drain = service.core.drain_inbox

    def flaky_drain():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        real_drain()

    monkeypatch.setattr(service.core, "drain_inbox", flaky_drain)
    sink = ListSink()
    service.submit("after-fault", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), sink)
    assert sink.done.wait(10) and sink.outputs[-1].completion_tokens == 2
    assert calls["n"] > 1


@pytest.mark.parametrize("where", ["step", "loop"])
def test_a_failing_step_or_loop_fails_the_requests_in_flight_as_internal(service, monkeypatch, where):
    """A fault is the server's (kind INTERNAL: 500 at the front door), whether the engine step or the loop around
    it failed; an engine-loop failure used to reach clients as INVALID_ARG, a 400."""
    sink = ListSink()
    if where == "step":
        real_step = service.engine.step
        calls = {"n": 0}

        def failing_step():
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected step fault")
            return real_step()

        monkeypatch.setattr(service.engine, "step", failing_step)
    else:
        real_run_once = service.core.run_once

        def failing_iteration():
            real_run_once()
            if service.engine.has_unfinished() and not failing_iteration.done:
                failing_iteration.done = True
                raise RuntimeError("injected loop fault")

        failing_iteration.done = False
        monkeypatch.setattr(service.core, "run_once", failing_iteration)
    service.submit(f"fails-in-{where}", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), sink)
    assert sink.done.wait(10) and len(sink.errors) == 1
    error = sink.errors[0]
    assert (error.kind, error.message) == (ErrorKind.INTERNAL, f"engine {where} failed (see server log)")
    assert StageError.parse(error.wire()).kind is ErrorKind.INTERNAL


def test_a_full_queue_refuses_at_once_and_every_accepted_request_completes(tiny_qwen2_path):
    engine = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=64,
                                    max_num_seqs=2, max_model_len=512))
    service = LLMService(engine, max_queued_requests=3)
    assert service.capacity == 5
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stream=True)
    sinks = [ListSink() for _ in range(5)]
    for i, sink in enumerate(sinks):  # not started yet: all five stay held (2 to run, 3 waiting)
        service.submit(f"r{i}", [10 + i, 20, 30], params, sink)
    with pytest.raises(QueueFull, match=r"^waiting queue is full: the llm stage holds 5 requests \(max_num_seqs 2 "
                                        r"running \+ max_queued_requests 3 waiting\); retry later$"):
        service.submit("r5", [15, 20, 30], params, ListSink())
    assert service.num_rejected == 1 and service.num_active == 5 and "r5" not in service.router.held()
    service.start()
    try:
        offline = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=64,
                                         max_model_len=512)).generate([[10 + i, 20, 30] for i in range(5)], params)
        for sink, expected in zip(sinks, offline):
            assert sink.done.wait(30)
            assert sink.errors == []
            assert [t for o in sink.outputs for t in o.token_ids] == expected.token_ids
            assert (sink.outputs[-1].completion_tokens, sink.outputs[-1].finish_reason) == (6, "length")
        after = ListSink()
        service.submit("after", [15, 20, 30], params, after)  # room again
        assert after.done.wait(30) and after.outputs[-1].completion_tokens == 6
        assert service.num_active == 0
    finally:
        service.shutdown()


def test_max_queued_requests_parameter():
    assert parse_parameters({"model_path": "x", "max_queued_requests": "7"}).stage.max_queued_requests == 7
    assert parse_parameters({"model_path": "x", "max_queued_requests": "0"}).stage.max_queued_requests == 0  # no limit
    assert parse_parameters({"model_path": "x", "max_queued_requests": ""}).stage.max_queued_requests == 256
    with pytest.raises(ValueError, match="setting max_queued_requests must be an integer >= 0, got '-1'"):
        parse_parameters({"model_path": "x", "max_queued_requests": "-1"})
    with pytest.raises(ValueError, match="setting max_queued_requests must be an integer >= 0, got 'many'"):
        parse_parameters({"model_path": "x", "max_queued_requests": "many"})


def test_once_the_server_is_stopping_requests_still_running_after_the_grace_are_aborted(tiny_qwen2_path):
    engine = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=64,
                                    max_num_seqs=4, max_model_len=512))
    probe = {"stopping": False}
    service = LLMService(engine, stopping=lambda: probe["stopping"], stop_grace_s=30.0)
    sink = ListSink()
    service.submit("long", [4, 5, 6], SamplingParams(max_tokens=400, ignore_eos=True, stream=True), sink)
    # not started yet: the test plays the watch thread (and then the engine loop) itself
    watch = service.stop_watch
    watch.look()
    assert watch.deadline is None  # the server answered: not stopping
    probe["stopping"] = True
    before = time.monotonic()
    watch.look()
    assert before + 30.0 <= watch.deadline <= time.monotonic() + 30.0
    probe["stopping"] = False  # answering again within the grace: a false alarm
    watch.look()
    assert watch.deadline is None
    probe["stopping"], watch.grace_s = True, 0.0
    watch.look()  # the grace is over at once: the request still held is aborted
    assert watch.deadline is not None
    service.core.run_once()  # the engine loop takes the request and its abort
    service.start()
    try:
        assert sink.done.wait(10)
        assert sink.errors == [] and (sink.outputs[-1].finish_reason, sink.outputs[-1].completion_tokens) == (
            "abort", 0)
        assert service.num_active == 0 and engine.runner.block_manager.num_free_blocks == 64
    finally:
        service.shutdown()


def test_a_probe_that_never_said_ready_aborts_nothing(tiny_qwen2_path):
    engine = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=64,
                                    max_num_seqs=4, max_model_len=512))
    service = LLMService(engine, stopping=lambda: True, stop_grace_s=0.0)
    sink = ListSink()
    service.submit("r", [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True), sink)
    # not started: the test plays the watch thread while the request is held, then lets the loop run
    service.stop_watch.look()
    assert service.stop_watch.deadline is None
    service.start()
    try:
        assert sink.done.wait(30)
        assert (sink.outputs[-1].finish_reason, sink.outputs[-1].completion_tokens) == ("length", 40)
        assert service.stop_watch.deadline is None
    finally:
        service.shutdown()


def test_the_stop_probe_reads_the_parent_tritonserver_command_line():
    flags = tritonserver_flags(["/opt/tritonserver/bin/tritonserver", "--model-repository=/m", "--http-port", "8123",
                                "--exit-timeout-secs=12", "--log-verbose=0"])
    assert flags == {"model-repository": "/m", "http-port": "8123", "exit-timeout-secs": "12", "log-verbose": "0"}
    import os
    assert parent_server_probe(os.getpid()) == (None, None)  # a python process is not a tritonserver


def test_the_operator_key_is_read_from_the_restricted_api_flags():
    flags = tritonserver_flags(["tritonserver", "--model-repository=/m", *restricted_api_flags("k3y:with=signs")])
    assert admin_key_of(flags) == "k3y:with=signs"
    assert admin_key_of(tritonserver_flags(["tritonserver", "--http-restricted-api=logging:other-header=x"])) is None
    assert admin_key_of({}) is None
    import os
    assert parent_operator_key(os.getpid()) is None  # a python process is not a tritonserver


def test_generation_and_reset_requests_are_told_apart_by_their_inputs():
    ids = np.array([5, 6, 7], dtype=np.int32)
    params = np.array([SamplingParams(max_tokens=3).to_json().encode()], dtype=np.object_)
    reset = np.array([True])
    assert generation_inputs({"input_ids": ids, "sampling_params": params}) == (
        [5, 6, 7], SamplingParams(max_tokens=3), None, None)
    assert not is_reset_request({"input_ids": ids, "sampling_params": params})
    assert not is_reset_request({"reset_prefix_cache": np.array([False]), "input_ids": ids})
    assert is_reset_request({"reset_prefix_cache": reset})
    for missing in ("input_ids", "sampling_params"):
        arrays = {"input_ids": ids, "sampling_params": params}
        del arrays[missing]
        with pytest.raises(FieldError, match=f"^{missing} is required") as excinfo:
            generation_inputs(arrays)
        assert StageError.of(excinfo.value, "llm").kind is ErrorKind.INVALID_ARGUMENT
    with pytest.raises(FieldError, match="reset_prefix_cache is a request of its own: send it without input_ids"):
        is_reset_request({"reset_prefix_cache": reset, "input_ids": ids})


def test_the_operator_resets_the_prefix_cache_with_the_key_only(tiny_qwen2_path):
    engine = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=64, block_size=16,
                                    max_num_seqs=4, max_model_len=512))
    service = LLMService(engine, operator_key="k3y")
    service.start()
    try:
        prompt = list(range(100, 150))  # 50 tokens: 3 full blocks cached once it finished
        sinks = [ListSink(), ListSink()]
        for i, sink in enumerate(sinks):
            service.submit(f"r{i}", prompt, SamplingParams(max_tokens=2, ignore_eos=True), sink)
            assert sink.done.wait(30)
        assert [s.outputs[-1].cached_tokens for s in sinks] == [0, 48]
        for wrong in (None, "wrong", 123):
            with pytest.raises(StageError, match=f"^{ADMIN_KEY_HEADER} ") as excinfo:
                service.reset_prefix_cache_as_operator(wrong)
            assert (excinfo.value.kind, excinfo.value.field) == (ErrorKind.INVALID_ARGUMENT, ADMIN_KEY_HEADER)
        assert service.reset_prefix_cache_as_operator("k3y") == 3
        assert service.reset_prefix_cache_as_operator("k3y") == 0
        again = ListSink()
        service.submit("r2", prompt, SamplingParams(max_tokens=2, ignore_eos=True), again)
        assert again.done.wait(30) and again.outputs[-1].cached_tokens == 0
        service.operator_key = None  # a tritonserver without restricted-API flags: nobody is the operator
        with pytest.raises(StageError, match="no operator key"):
            service.reset_prefix_cache_as_operator("k3y")
    finally:
        service.shutdown()


def test_the_heartbeat_stops_when_a_loop_is_stuck_not_when_a_step_is_slow(tiny_qwen2_path):
    service = LLMService(LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=16,
                                                max_model_len=512)))
    # not started: the test sets when each loop last began an iteration
    before = time.time()
    assert before <= service.heartbeat_time() <= time.time()
    service.router.last_iteration = time.monotonic() - LOOP_STUCK_AFTER_S / 2  # slow, not stuck
    assert before <= service.heartbeat_time() <= time.time()
    service.core.last_iteration = time.monotonic() - LOOP_STUCK_AFTER_S - 5  # stuck
    assert time.time() - LOOP_STUCK_AFTER_S - 6 <= service.heartbeat_time() <= time.time() - LOOP_STUCK_AFTER_S - 5


def test_reset_prefix_cache_drops_the_cached_blocks_between_steps(service):
    prompt = list(range(300, 340))  # 40 tokens: 2 full blocks
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for name in ("first", "second"):
        sink = ListSink()
        service.submit(name, prompt, params, sink)
        assert sink.done.wait(30)
    assert sink.outputs[-1].cached_tokens == 32
    assert service.reset_prefix_cache().result(timeout=10) == 2  # the prompt's two full blocks
    sink = ListSink()
    service.submit("third", prompt, params, sink)
    assert sink.done.wait(30)
    assert sink.outputs[-1].cached_tokens == 0


def test_a_cancel_that_overtakes_its_generation_or_reaches_another_instance_still_ends_it(tiny_qwen2_path, tmp_path):
    """Two llm instances share a cancel board (one per GPU in production): a cancel sent to the instance that does
    not hold the generation ends it on the other; a cancel sent before its generation arrived ends it on arrival."""
    from omni_backend.stages.llm.cancel_board import CancelBoard

    def instance():
        engine = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=64,
                                        max_num_seqs=4, max_model_len=512))
        return LLMService(engine, cancel_board=CancelBoard(tmp_path / "board"))

    holder, other = instance(), instance()
    for service in (holder, other):
        service.start()
    try:
        params = SamplingParams(max_tokens=400, ignore_eos=True, stream=True)
        sink = ListSink()
        holder.submit("omni_chat-key-1", [5, 6, 7], params, sink)
        deadline = time.monotonic() + 10
        while not sink.outputs and time.monotonic() < deadline:
            time.sleep(0.01)
        other.cancel("omni_chat-key-1")  # the wrong instance: it posts the cancel on the board
        assert sink.done.wait(5) and sink.closed == 1 and sink.outputs[-1].completion_tokens < 400
        early = ListSink()
        holder.cancel("omni_chat-key-2")  # before the generation: remembered
        holder.submit("omni_chat-key-2", [5, 6, 8], params, early)
        assert early.done.wait(5) and early.closed == 1
        assert list((tmp_path / "board").iterdir()) == []  # every posted cancel was used up
    finally:
        for service in (holder, other):
            service.shutdown()


def test_responses_carry_the_thinker_rows_only_when_asked():
    from omni_backend.engine.llm_engine import RequestOutput

    plain = RequestOutput("r", "a", [7], None, 3, 1)
    assert "hidden_states" not in output_arrays(plain) and "input_embeds" not in output_arrays(plain)
    hidden, embeds = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2), torch.ones(3, 2)
    arrays = output_arrays(RequestOutput("r", "a", [7], None, 3, 1, hidden_states=hidden, input_embeds=embeds))
    assert arrays["hidden_states"].dtype == np.float32 and arrays["hidden_states"].tolist() == hidden.float().tolist()
    assert arrays["input_embeds"].tolist() == [[1.0, 1.0]] * 3
