"""The power/temperature governor on a real engine loop, with a fake NVML source (issue 7 acceptance)."""

from __future__ import annotations

import logging
import time

import pytest
from helpers.list_sink import ListSink

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.ops.fake_nvml import FakeGpu, FakeNvml
from omni_backend.ops.governor import Governor, GovernorConfig, GovernorState
from omni_backend.ops.hardware import Nvml
from omni_backend.stages.llm.service import LLMService, NotAdmitting

MAX_SEQS = 8


def make_service(path, gpu: FakeGpu, **governor_settings) -> LLMService:
    engine = LLMEngine(EngineConfig(model_path=path, dtype="float32", num_kv_blocks=128, max_num_seqs=MAX_SEQS,
                                    max_model_len=256))
    config = GovernorConfig(interval_s=0.0, **governor_settings)  # a reading at every loop iteration
    return LLMService(engine, Governor(MAX_SEQS, config, Nvml(FakeNvml([gpu]))))


def scheduled_per_step(service: LLMService) -> int:
    """Run one loop iteration; returns how many sequences computed a token in it."""
    seqs = [state.seq for state in service.engine.requests.values()]
    before = {id(s): s.num_computed_tokens for s in seqs}
    service.core.run_once()
    return sum(s.num_computed_tokens != before[id(s)] for s in seqs)


def test_power_above_threshold_lowers_seqs_per_step_within_two_steps_and_restores_with_hysteresis(tiny_llama_path):
    gpu = FakeGpu(power_limit_w=300, power_w=150)  # threshold 270 W, restore below 255 W (5 % hysteresis)
    service = make_service(tiny_llama_path, gpu)
    sinks = [ListSink() for _ in range(MAX_SEQS)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stream=True)
    for i, sink in enumerate(sinks):
        service.submit(f"r{i}", [10 + i, 20, 30], params, sink)
    service.core.run_once()  # admits and prefills all of them
    for _ in range(3):
        assert scheduled_per_step(service) == MAX_SEQS
    assert service.governor.state is GovernorState.NORMAL

    gpu.power_w = 290
    counts = [scheduled_per_step(service) for _ in range(2)]
    assert min(counts) < MAX_SEQS, counts  # lowered within 2 steps
    counts += [scheduled_per_step(service) for _ in range(6)]
    assert counts == sorted(counts, reverse=True) and counts[-1] == 1, counts  # stepwise, down to the minimum
    assert service.governor.state is GovernorState.POWER_LIMITED

    gpu.power_w = 262  # below the threshold but inside the hysteresis band: hold
    assert [scheduled_per_step(service) for _ in range(4)] == [1] * 4

    gpu.power_w = 200
    counts = [scheduled_per_step(service) for _ in range(6)]
    assert counts[0] == 1 + service.governor.step and counts == sorted(counts), counts  # stepwise back up
    assert counts[-1] == MAX_SEQS and service.governor.state is GovernorState.NORMAL

    while service.engine.has_unfinished():  # every request still completes, with all its tokens
        service.core.run_once()
    while not service.core.outbox.empty():  # what the response thread would send
        service.router.deliver(*service.core.outbox.get_nowait())
    assert all(sum(len(o.token_ids) for o in s.outputs) == 60 for s in sinks)


def test_critical_temperature_rejects_new_requests_while_running_ones_finish(tiny_llama_path):
    gpu = FakeGpu(temperature_c=60, slowdown_temp_c=90)  # critical 90 C, admit again below 85 C
    service = make_service(tiny_llama_path, gpu)
    service.start()
    try:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, stream=True)
        running = [ListSink() for _ in range(2)]
        for i, sink in enumerate(running):
            service.submit(f"run{i}", [5, 6, 7 + i], params, sink)
        deadline = time.monotonic() + 10
        while not all(s.outputs for s in running) and time.monotonic() < deadline:
            time.sleep(0.005)
        gpu.temperature_c = 92
        deadline = time.monotonic() + 5
        while service.governor.admitting and time.monotonic() < deadline:
            time.sleep(0.005)
        assert service.governor.state is GovernorState.NOT_ADMITTING
        assert not all(s.done.is_set() for s in running)  # the test saw the running ones mid-flight
        with pytest.raises(NotAdmitting, match="critical 90 C; retry after 10 s"):
            service.submit("new", [1, 2, 3], SamplingParams(max_tokens=4), ListSink())

        gpu.temperature_c = 87  # cooler, but inside the 5 C hysteresis: still refusing
        time.sleep(0.05)
        with pytest.raises(NotAdmitting):
            service.submit("new2", [1, 2, 3], SamplingParams(max_tokens=4), ListSink())
        for sink in running:
            assert sink.done.wait(30)
            assert not sink.errors and sink.outputs[-1].finish_reason == "length"
            assert sink.outputs[-1].completion_tokens == 200

        gpu.temperature_c = 70
        deadline = time.monotonic() + 5
        while not service.governor.admitting and time.monotonic() < deadline:
            time.sleep(0.005)
        after = ListSink()
        service.submit("after", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), after)
        assert after.done.wait(10) and after.outputs[-1].completion_tokens == 4
    finally:
        service.shutdown()


def test_without_nvml_one_log_line_and_gauge_zero(tiny_llama_path, caplog):
    caplog.set_level(logging.WARNING, logger="omni_backend.ops.governor")
    for module in (FakeNvml(missing=True), None):  # None: the real pynvml, absent on a CPU machine
        caplog.clear()
        governor = Governor.for_device("cuda:0", MAX_SEQS, nvml_module=module)
        if module is None and governor.enabled:
            pytest.skip("this machine has NVML")
        for step in range(20):
            assert governor.tick(float(step)) == MAX_SEQS
        assert governor.refusal() is None  # never refuses
        lines = [r.getMessage() for r in caplog.records if "governor" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("governor disabled: NVML unavailable ("), lines
        assert governor.state is GovernorState.DISABLED and int(governor.state) == 0

    engine = LLMEngine(EngineConfig(model_path=tiny_llama_path, dtype="float32", num_kv_blocks=32,
                                    max_num_seqs=MAX_SEQS, max_model_len=256))
    stats = LLMService(engine, Governor.for_device("cpu", MAX_SEQS, nvml_module=FakeNvml(missing=True))).stats()
    assert (stats.governor_state, stats.power_w, stats.temperature_c, stats.num_seqs_limit) == (0, 0.0, 0.0, MAX_SEQS)


def test_thresholds_derive_from_the_gpu_when_not_set():
    governor = Governor.for_device("cuda:0", 32, GovernorConfig(), nvml_module=FakeNvml([FakeGpu(
        power_limit_w=400, slowdown_temp_c=None)]))
    assert governor.enabled and governor.gpu.power_limit_w == 400
    assert (governor.power_threshold_w, governor.hysteresis_w, governor.critical_temp_c, governor.step) == (
        360.0, 20.0, 85.0, 8)
    config = GovernorConfig.from_strings({"governor_power_threshold_w": "250", "governor_critical_temp_c": "80",
                                          "governor_power_fraction": "", "governor_interval_s": "0.5"}, "governor_")
    assert (config.power_threshold_w, config.critical_temp_c, config.power_fraction) == (250.0, 80.0, 0.9)
    with pytest.raises(ValueError, match="setting governor_min_num_seqs must be an integer >= 1, got 'two'"):
        GovernorConfig.from_strings({"governor_min_num_seqs": "two"}, "governor_")


def test_each_gpu_engine_gets_the_governor_of_its_own_gpu():
    """One llm instance per GPU (KIND_GPU): the engine on cuda:1 reads GPU 1, with GPU 1's limits."""
    nvml = FakeNvml([FakeGpu(uuid="GPU-a", power_limit_w=700), FakeGpu(uuid="GPU-b", power_limit_w=350)])
    first, second = (Governor.for_device(f"cuda:{i}", 32, GovernorConfig(), nvml_module=nvml) for i in (0, 1))
    assert (first.gpu_index, first.gpu.power_limit_w, first.power_threshold_w) == (0, 700, 630.0)
    assert (second.gpu_index, second.gpu.power_limit_w, second.power_threshold_w) == (1, 350, 315.0)
    nvml.gpus[1].power_w = 340  # only GPU 1 runs hot: only its engine lowers its sequences per step
    first.tick(1.0), second.tick(1.0)
    assert first.num_seqs == 32 and second.num_seqs == 24
