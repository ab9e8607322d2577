"""The llm stage's metrics and governor on a real tritonserver, with a fake NVML file (issue 7 acceptance).

The server (`governed_server` in conftest.py) gives its llm stage a fake NVML file, so the test sets the GPU's
power and temperature while requests run.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from helpers.chat_client import chat_messages, http_generate, make_inputs, stream_infer, stream_inputs
from helpers.kv_event_subscriber import KVEventSubscriber
from helpers.llm_stream import as_llm_inputs, preprocessed

from omni_backend.ops.hardware import cpu_has_native_bf16
from omni_backend.ops.metrics import admitting, parse_metrics
from omni_backend.vocabulary import ErrorKind, StageError
from omni_backend.ops.ready import check
from omni_backend.operator_key import ADMIN_KEY_HEADER

pytestmark = pytest.mark.server

LABELS = {"model": "llm", "version": "1"}


def scrape(server) -> dict:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        return parse_metrics(response.read().decode())


def value(samples: dict, name: str, **labels) -> float:
    """The one sample of `name` whose labels include LABELS and `labels` (0 when absent, as a new counter)."""
    want = {**LABELS, **labels}
    found = [v for got, v in samples.get(name, []) if want.items() <= got.items()]
    assert len(found) <= 1, (name, found)
    return found[0] if found else 0.0


def wait_for(predicate, timeout_s: float = 15.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def scrape_until(server, condition, what: str) -> dict:
    """Scrape until `condition(samples)` holds (the stage publishes about once a second); returns the samples."""
    found = {}

    def check():
        found["samples"] = scrape(server)
        return condition(found["samples"])

    wait_for(check, what=what)
    return found["samples"]


# Decode on the CI machine (2 cores, SmolLM2, one sequence): about 20 ms per token.
LONG_TOKENS = 256
CRITICAL_LONG_TOKENS = 480

HISTOGRAMS = ("omni_time_to_first_token_seconds", "omni_inter_token_latency_seconds",
              "omni_e2e_request_latency_seconds", "omni_queue_time_seconds")


def test_metrics_page_has_every_family_with_plausible_values(governed_server):
    server = governed_server
    before = scrape(server)
    long_result = {}
    # Long enough (about 5 s of decode steps on the 2-core CI machine) to be seen running by a scrape: the stage
    # publishes once a second, and at 48 tokens the C++ decode kernel finished it before some publications.
    long = threading.Thread(target=lambda: long_result.update(r=stream_infer(server.grpc_url, {
        "text_input": "Count slowly:", "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True,
        "temperature": 0})))
    long.start()
    during = scrape_until(server, lambda s: value(s, "omni_requests_running") == 1, "a running request")
    assert value(during, "omni_kv_cache_blocks_used") >= 1
    long.join(120)

    served = [long_result["r"]]
    served.append(stream_infer(server.grpc_url, {"text_input": chat_messages("What is the capital of France?"),
                                                 "max_tokens": 16, "stream": True, "temperature": 0}))
    # with logprobs: the entry point calls postprocess only for responses that carry them
    served.append(stream_infer(server.grpc_url, {"text_input": "One", "max_tokens": 1, "stream": True,
                                                 "logprobs": 1}))
    # the same chat again: its full prompt blocks come from the prefix cache
    served.append(stream_infer(server.grpc_url, {"text_input": chat_messages("What is the capital of France?"),
                                                 "max_tokens": 4, "stream": True, "temperature": 0}))
    status, body = http_generate(server.http_url, {"text_input": "Once upon a time", "max_tokens": 6,
                                                   "temperature": 0})
    assert status == 200, body
    assert all(r.error is None for r in served), [r.error for r in served]
    prompt = sum(r.last("prompt_tokens") for r in served) + body["prompt_tokens"]
    completion = [r.last("completion_tokens") for r in served] + [body["completion_tokens"]]
    requests = len(completion)

    after = scrape_until(server, lambda s: value(s, "omni_generation_tokens_total") - value(
        before, "omni_generation_tokens_total") == sum(completion), "the generation tokens published")
    delta = lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)  # noqa: E731

    # token counters equal the tokens served
    assert delta("omni_generation_tokens_total") == sum(completion)
    assert delta("omni_prompt_tokens_total") == prompt
    # histograms: one observation per request (ITL: per request with at least two tokens), seconds
    for name in HISTOGRAMS:
        expected = sum(c > 1 for c in completion) if "inter_token" in name else requests
        assert delta(f"{name}_count") == expected, name
        assert delta(f"{name}_bucket", le="+Inf") == expected, name
    ttft, e2e = delta("omni_time_to_first_token_seconds_sum"), delta("omni_e2e_request_latency_seconds_sum")
    queue = delta("omni_queue_time_seconds_sum")
    assert 0 <= queue <= ttft < e2e < 120, (queue, ttft, e2e)
    itl_mean = delta("omni_inter_token_latency_seconds_sum") / delta("omni_inter_token_latency_seconds_count")
    assert 0.001 < itl_mean < 2.0, itl_mean
    # engine gauges and counters
    assert value(after, "omni_requests_running") == 0 and value(after, "omni_requests_waiting") == 0
    assert value(after, "omni_kv_cache_blocks_used") == 0 < value(after, "omni_kv_cache_blocks_total")
    assert "omni_preemptions_total" in after and delta("omni_preemptions_total") == 0
    # prefix cache: every prompt token looked up once (no preemption); the repeated chat's full blocks hit (16-token
    # blocks, its last token always computed); earlier tests may have left other prompts of these in the cache
    repeated = served[-1].last("prompt_tokens")
    assert delta("omni_prefix_cache_queries_total") == prompt
    assert (repeated - 1) // 16 * 16 <= delta("omni_prefix_cache_hits_total") < prompt
    assert value(after, "omni_prefix_cache_blocks") >= (repeated - 1) // 16
    assert value(after, "omni_prefix_cache_enabled") == 1
    assert delta("omni_engine_steps_total", mode="eager") >= max(completion)  # CPU: every step eager
    # one request at a time: every step ran one sequence (batches above 1: test_qwen2_5_omni_voice_server.py)
    assert delta("omni_engine_step_sequences_total") == delta("omni_engine_steps_total", mode="eager")
    assert value(after, "omni_engine_steps_total", mode="cuda_graph") == 0
    assert "omni_cuda_graph_padded_rows_total" in after
    # the C++ decode kernel (CPU default), or torch where there is no compiler to build it
    cpu_kernel_buildable = shutil.which(os.environ.get("CXX", "g++")) is not None
    backend = "cpu" if cpu_kernel_buildable else "torch"
    assert value(after, "omni_attention_backend", backend=backend, device="cpu") == 1
    # the versions it runs with and no fallback from the first choice: torch's CUDA is empty (a CPU build), the
    # driver's CUDA is what the fake GPU's NVML reports (FakeNvml's default, 13000: CUDA 13.0)
    import torch
    import triton
    # matmuls: the C++ float32 step; dtype "auto" (this server's) on an AVX512-BF16/AMX CPU measures which of the
    # float32 and bfloat16 C++ steps and oneDNN's bfloat16 is fastest here (engine/cpu_dtype.py) and says so
    info = dict(torch=torch.__version__, triton=triton.__version__, cuda_runtime="", cuda_driver="13.0",
                attention_backend=backend)
    if not cpu_has_native_bf16():
        info.update(dtype="float32", dtype_reason="auto: by device",
                    matmuls="cpu-kernels-float32" if cpu_kernel_buildable else "onednn-packed")
    else:
        [labels] = [got for got, _ in after["omni_runtime_info"]]
        assert labels["dtype_reason"].startswith("auto: measured"), labels
        kernels = {"float32": "cpu-kernels-float32", "bfloat16": "cpu-kernels-bfloat16"}
        onednn = "bfloat16-onednn" in labels["dtype_reason"].split("fastest ")[1].split(" (")[0]
        info.update(dtype=labels["dtype"], matmuls="onednn-packed" if onednn or not cpu_kernel_buildable
                    else kernels[labels["dtype"]])
    if cpu_kernel_buildable:  # the selector's first choice on a CPU, kept
        info.update(fallback_reason="", attention_reason="auto: CPU device (C++ paged decode kernel; Triton kernels "
                                                         "only under TRITON_INTERPRET=1)")
    assert value(after, "omni_runtime_info", **info) == 1
    [labels] = [got for got, _ in after["omni_runtime_info"]]
    want_kernels = {"cpu-kernels-float32": {"fma"}, "cpu-kernels-bfloat16": {"amx", "avx512_bf16", "avx512_fma"}}
    assert labels["matmul_kernel"] in want_kernels.get(info["matmuls"], {""}), labels
    assert "omni_oom_recoveries_total" in after and delta("omni_oom_recoveries_total") == 0
    # governor and GPU readings (the fake GPU: 120 W of 300, 50 C)
    gpu = server.fake_gpu
    assert value(after, "omni_governor_state") == 1 and value(after, "omni_governor_max_num_seqs") == 8
    assert value(after, "omni_gpu_power_watts") == gpu["power_w"]
    assert value(after, "omni_gpu_temperature_celsius") == gpu["temperature_c"]
    assert value(after, "omni_gpu_sm_clock_mhz") == gpu["sm_clock_mhz"]
    # queue time of the other stages: Triton's own per-model counter
    for stage in ("preprocess", "postprocess"):
        assert value(after, "nv_inference_queue_duration_us", model=stage) > 0


def test_critical_temperature_turns_new_requests_away_while_running_ones_finish(governed_server):
    server = governed_server
    long_result = {}
    # Still running after the scrape that sees it (<= 1.2 s), the governor's next reading (<= 0.5 s), the next
    # publication (<= 1 s) and the refusals below: about 10 s of decode steps on the 2-core CI machine.
    long = threading.Thread(target=lambda: long_result.update(r=stream_infer(server.grpc_url, {
        "text_input": "Count slowly:", "max_tokens": CRITICAL_LONG_TOKENS, "ignore_eos": True, "stream": True,
        "temperature": 0})))
    long.start()
    scrape_until(server, lambda s: value(s, "omni_requests_running") == 1, "the long request running")
    try:
        server.nvml_file.write_text(json.dumps({**server.fake_gpu, "temperature_c": 95}))
        wait_for(lambda: not admitting(server.metrics_url)[0], what="readiness reporting not admitting")
        assert value(scrape(server), "omni_governor_state") == 3
        ready, reason = check(server.http_url, server.metrics_url)  # the deployments' readiness probe
        assert not ready and "llm/1" in reason, reason
        assert long.is_alive()  # still running while new requests are refused

        # The stage answers UNAVAILABLE; Triton 2.51 hands clients of a decoupled model only the message
        # (/generate answers 400, seen here; a later Triton's 503 is accepted too), whose header carries the
        # kind and the wait, which the front door turns into 503 + Retry-After.
        status, body = http_generate(server.http_url, {"text_input": "Hello", "max_tokens": 4})
        refusal = StageError.parse(body["error"])
        assert status in (400, 503) and (refusal.kind, refusal.retry_after_s) == (ErrorKind.NOT_ADMITTING, 10), body
        refused = stream_infer(server.grpc_url, {"text_input": "Hello", "max_tokens": 4, "stream": True})
        refusal = StageError.parse(refused.error)
        assert (refusal.kind, refusal.retry_after_s) == (ErrorKind.NOT_ADMITTING, 10), refused.error

        long.join(180)
        finished = long_result["r"]
        assert finished.error is None and finished.last("finish_reason") == "length"
        assert finished.last("completion_tokens") == CRITICAL_LONG_TOKENS
    finally:
        server.nvml_file.write_text(json.dumps(server.fake_gpu))
        long.join(180)
    wait_for(lambda: admitting(server.metrics_url)[0], what="admitting again after cooling down")
    assert check(server.http_url, server.metrics_url) == (True, "ok")
    status, body = http_generate(server.http_url, {"text_input": "Hello", "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and body["completion_tokens"] == 4, body


STANDARD = {"model_name": "llm", "engine": "0"}  # vLLM's labels: the model its clients address, the engine index


def standard(samples: dict, name: str, **labels) -> float:
    """The one sample of a vLLM-named family with STANDARD labels (and `labels`); 0 when absent."""
    found = [v for got, v in samples.get(name, []) if {**STANDARD, **labels}.items() <= got.items()]
    assert len(found) <= 1, (name, found)
    return found[0] if found else 0.0


# Held requests: 8 running decode this many tokens before they could finish, however fast the machine (1,024
# steps of 8 sequences, many 1 s publications); the test cancels them once a scrape has seen them. A short prompt
# + 1,024 tokens (65 blocks of 16) fits 8 times in the governed server's KV cache (728 blocks in float32), so none
# is preempted while held.
HELD_TOKENS = 1024


def test_the_standard_gauges_follow_the_queue(governed_server):
    """12 requests at once on an engine of 8 sequences per step: vllm:num_requests_running shows the 8, waiting the
    rest, kv_cache_usage_perc the blocks they hold (the omni_ gauges of the same snapshot); all go back to 0 once
    they are cancelled, and finished requests get one TTFT and one ITL observation each, the omni_ histograms'
    own."""
    server = governed_server
    clients = [grpcclient.InferenceServerClient(server.grpc_url) for _ in range(12)]
    try:
        for i, client in enumerate(clients):
            client.start_stream(callback=lambda result, error: None)
            client.async_stream_infer("omni_chat", make_inputs({
                "text_input": f"Count to {i}:", "max_tokens": HELD_TOKENS, "ignore_eos": True, "stream": True,
                "temperature": 0}, grpcclient))

        def queued(s):
            used, total = value(s, "omni_kv_cache_blocks_used"), value(s, "omni_kv_cache_blocks_total")
            return (standard(s, "vllm:num_requests_running") == 8 and standard(s, "vllm:num_requests_waiting") == 4
                    and value(s, "omni_requests_waiting") == 4 and used > 0
                    and standard(s, "vllm:kv_cache_usage_perc") == pytest.approx(used / total, abs=1e-9))

        during = scrape_until(server, queued, "8 running and 4 waiting on the standard gauges")
        assert 0 < standard(during, "vllm:kv_cache_usage_perc") < 1
    finally:
        for client in clients:
            client.stop_stream(cancel_requests=True)
            client.close()
    scrape_until(server, lambda s: standard(s, "vllm:num_requests_running") == standard(
        s, "vllm:num_requests_waiting") == standard(s, "vllm:kv_cache_usage_perc") == 0, "the gauges back to 0")

    # cancelled requests are not observed: two that finish are
    before = scrape(server)
    finished = [stream_infer(server.grpc_url, {"text_input": f"Count to {i}:", "max_tokens": 8, "ignore_eos": True,
                                               "stream": True, "temperature": 0}) for i in range(2)]
    assert all(r.error is None and r.last("completion_tokens") == 8 for r in finished)
    # a request of an earlier test may be published after `before`: compare with the omni_ histograms, which get
    # the same observations in the same publication (the omni_ ones first)
    delta = lambda s, name, of=standard, **labels: of(s, name, **labels) - of(before, name, **labels)  # noqa: E731
    after = scrape_until(server, lambda s: delta(s, "vllm:time_to_first_token_seconds_count") >= 2 and delta(
        s, "vllm:time_to_first_token_seconds_count") == delta(s, "omni_time_to_first_token_seconds_count", value),
        "the 2 requests' TTFTs published")
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for part in ("_count", "_sum"):
            assert delta(after, f"vllm:{name}{part}") == pytest.approx(delta(after, f"omni_{name}{part}", value),
                                                                       rel=1e-6), name + part
    assert delta(after, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == delta(
        after, "vllm:time_to_first_token_seconds_count")
    # vLLM's buckets
    assert "2560" in {labels.get("le") for labels, _ in after["vllm:time_to_first_token_seconds_bucket"]}
    itl_sum, itl_count = (delta(after, f"vllm:inter_token_latency_seconds{part}") for part in ("_sum", "_count"))
    assert 0.001 < itl_sum / itl_count < 2.0


def test_the_llm_stage_publishes_its_kv_events_on_the_endpoint_of_its_setting(governed_server):
    """The kv_events setting rendered into the llm model's config: a request's computed full blocks arrive as
    BlockStored events with its token ids, and an operator's reset as AllBlocksCleared."""
    server = governed_server
    reset = grpcclient.InferInput("reset_prefix_cache", [1], "BOOL")
    reset.set_data_from_numpy(np.array([True]))

    def reset_cache():
        done = stream_inputs(server.grpc_url, [reset], "llm", parameters={ADMIN_KEY_HEADER: server.admin_key})
        assert done.error is None, done.error

    sub = KVEventSubscriber(server.kv_events)
    try:
        sub.subscribe(reset_cache)
        arrays = preprocessed(server.grpc_url, f"KV events {time.time()}: count to twenty, one word each.", 4,
                              chat=False)
        result = stream_inputs(server.grpc_url, as_llm_inputs(arrays), "llm")
        assert result.error is None, result.error
        prompt = arrays["input_ids"].tolist()
        # prompt + 4 tokens, the last never computed: its full blocks of 16 are named
        blocks = (len(prompt) + 3) // 16
        stored, seqs = [], []
        while sum(len(event[1]) for event in stored) < blocks:
            topic, seq, (_, events, rank) = sub.receive()
            assert (topic, rank) == (b"", 0)
            seqs.append(seq)
            stored += [event for event in events if event[0] == "BlockStored"]
        assert stored[0][2] is None and all(event[4] == 16 for event in stored)  # the first block has no parent
        tokens = [t for event in stored for t in event[3]]
        assert len(tokens) == 16 * blocks and tokens[:len(prompt)] == prompt[:len(tokens)]
        reset_cache()
        topic, seq, (_, events, _) = sub.receive()
        assert events == [["AllBlocksCleared"]]
        assert seqs + [seq] == list(range(sub.last_probe + 1, seq + 1))
    finally:
        sub.close()
