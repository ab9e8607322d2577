"""Tensor parallelism on CPU: two ranks (gloo, a spawned second process) give TP=1's greedy tokens in float32,
on SmolLM2 (3 KV heads: an uneven 2 + 1 split) and on the tiny Qwen2 (QKV bias, untied head), through batched,
chunked prefills, prefix-cache hits and preemptions; the second rank is gone after `close` and when rank 0 is
killed; a second rank that dies fails the next request at once and takes the engine out of service; a rank > 0
builds no output head; a stage that fails after building its engine leaves no rank behind; and what cannot
shard is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers.list_sink import ListSink
from helpers.processes import descendants, gone, running
from transformers import AutoConfig

from omni_backend import checkpoints
from omni_backend.engine.attention.selector import select_attention
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.models.qwen2 import Qwen2ForCausalLM
from omni_backend.engine.models.registry import HF_LANGUAGE_MODEL_PREFIXES
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.tensor_parallel import HeadShard, Shard
from omni_backend.stages.llm.build import create_service
from omni_backend.stages.llm.service import LLMService
from omni_backend.vocabulary import ErrorKind

SYSTEM = "You answer questions about rivers, mountains and cities in one short sentence, politely. "
QUESTIONS = ["Where is the Nile?", "How high is Mont Blanc?", "Which river runs through Paris?",
             "Name a city on the Danube."]
# 8 blocks of 16 tokens for 4 sequences of ~22 prompt + 24 generated tokens (3 blocks each): they cannot all
# stay resident, so the scheduler preempts; the 32-token budget chunks the prefills.
LIMITS = {"num_kv_blocks": 8, "block_size": 16, "max_num_seqs": 4, "max_num_batched_tokens": 32,
          "max_model_len": 128}
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _run(path: str, tp: int) -> tuple[list[list[int]], list[int], int, LLMEngine]:
    """(tokens, cached tokens, preemptions) of two waves through a closed engine: the questions behind a shared
    system prompt, then the same again (their blocks cached)."""
    engine = LLMEngine(EngineConfig(model_path=path, dtype="float32", tensor_parallel_size=tp, cpu_threads=2,
                                    **LIMITS))
    try:
        prompts = [engine.tokenizer.encode(SYSTEM + q) for q in QUESTIONS]
        outputs = engine.generate(prompts, PARAMS) + engine.generate(prompts[:2], PARAMS)
        manager = engine.runner.block_manager
        assert manager.num_free_blocks == manager.num_blocks
        ranks = engine.runner.ranks._processes if tp > 1 else []
    finally:
        engine.close()
    assert all(process.exitcode == 0 for process in ranks)  # stopped by close
    return [o.token_ids for o in outputs], [o.cached_tokens for o in outputs], engine.scheduler.num_preemptions, \
        engine


@pytest.mark.parametrize("model_fixture", ["smollm2_path", "tiny_qwen2_path"])
def test_two_cpu_ranks_give_the_greedy_tokens_of_one(model_fixture, request):
    path = request.getfixturevalue(model_fixture)
    one, one_cached, one_preempted, _ = _run(path, 1)
    two, two_cached, two_preempted, engine = _run(path, 2)
    assert two == one
    assert one_preempted > 0 and two_preempted > 0
    assert two_cached == one_cached and sum(two_cached[len(QUESTIONS):]) > 0  # the repeats hit the prefix cache
    runner = engine.runner
    assert runner.matmuls == "onednn-packed" and runner.ranks is None  # closed
    assert runner.shard == Shard(0, 2)
    config = runner.hf_config
    assert runner.num_kv_heads == -(-config.num_key_value_heads // 2)  # rank 0 takes the larger half
    assert runner.kv_caches[0][0].shape[2] == runner.num_kv_heads


def test_the_second_rank_exits_when_rank_0_is_killed(tiny_qwen2_path):
    """No orphan: rank 1 waits for calls on a pipe, whose end closes with rank 0's process."""
    script = ("import sys, time\n"
              "from omni_backend.engine.config import EngineConfig\n"
              "from omni_backend.engine.llm_engine import LLMEngine\n"
              f"engine = LLMEngine(EngineConfig(model_path={tiny_qwen2_path!r}, dtype='float32', "
              f"tensor_parallel_size=2, **{LIMITS!r}))\n"
              "print(engine.runner.ranks._processes[0].pid, flush=True)\n"
              "time.sleep(600)\n")
    rank_0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        rank_1 = int(rank_0.stdout.readline())
        assert running(rank_1)
    finally:
        rank_0.kill()
        rank_0.wait()
    assert gone(rank_1, within_s=30)


def test_shards_split_kv_head_groups_and_mlp_units_unevenly():
    # SmolLM2-135M: 9 query heads over 3 KV heads, 1536 MLP units, on two ranks
    assert Shard(0, 2).heads(9, 3) == HeadShard(q_start=0, num_q=6, kv_start=0, num_kv=2)
    assert Shard(1, 2).heads(9, 3) == HeadShard(q_start=6, num_q=3, kv_start=2, num_kv=1)
    assert Shard(1, 2).heads(9, 3).qkv_spans(64) == ((384, 576), (128, 192), (128, 192))
    assert [Shard(r, 3).span(10) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError, match="exceeds the model's 2 KV heads"):
        Shard(0, 4).heads(8, 2)


def test_what_cannot_shard_is_refused(tiny_qwen2_path):
    with pytest.raises(ValueError, match="cannot shard"):
        EngineConfig(model_path=tiny_qwen2_path, quantization="int8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 exceeds the model's 2 KV heads"):
        LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", tensor_parallel_size=4, **LIMITS))


def test_a_dead_rank_fails_the_next_request_at_once_and_takes_the_engine_out_of_service(tiny_qwen2_path):
    """Rank 1 killed between requests: the next request fails with UNAVAILABLE naming it (no hang in an
    all-reduce), the engine loop ends (the heartbeat stops), later requests are refused and the engine takes no
    step."""
    engine = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", tensor_parallel_size=2,
                                    cpu_threads=2, **LIMITS))
    service = LLMService(engine)
    service.start()
    try:
        served = ListSink()
        service.submit("before", [1, 2, 3], PARAMS, served)
        assert served.done.wait(60) and served.outputs[-1].completion_tokens == PARAMS.max_tokens
        rank_1 = engine.runner.ranks._processes[0]
        os.kill(rank_1.pid, signal.SIGKILL)
        rank_1.join()
        failed = ListSink()
        service.submit("after", [1, 2, 3], PARAMS, failed)
        assert failed.done.wait(60) and not failed.outputs
        assert failed.errors[0].kind is ErrorKind.UNAVAILABLE
        assert "tensor-parallel rank 1 has exited (code -9)" in failed.errors[0].message
        service.core.join(60)
        assert not service.core.alive
        ended = time.time()
        assert service.heartbeat_time() < ended  # a live loop's heartbeat is now
        refused = ListSink()
        service.submit("later", [1, 2, 3], PARAMS, refused)
        assert refused.done.wait(10) and refused.errors[0].kind is ErrorKind.UNAVAILABLE
        with pytest.raises(RuntimeError, match="out of service: a tensor-parallel step failed"):
            engine.step()
    finally:
        service.shutdown()
    assert engine.runner.ranks is None


def test_a_rank_without_the_output_head_holds_no_head(tiny_qwen2_path):
    """What a rank > 0 builds (tp_ranks._Rank): no untied head, and no packed copy after packing."""
    config = AutoConfig.from_pretrained(tiny_qwen2_path)
    heads = Shard(1, 2).heads(config.num_attention_heads, config.num_key_value_heads)
    head_dim = checkpoints.head_dim(config)
    attention = select_attention("torch", torch.device("cpu"), heads.num_q, heads.num_kv, head_dim, torch.float32,
                                 16, "").backend
    model = Qwen2ForCausalLM.build(config, attention, 64, Shard(1, 2), torch.float32, torch.device("cpu"),
                                   tiny_qwen2_path, HF_LANGUAGE_MODEL_PREFIXES, head=False)
    assert model.lm_head is None
    model.pack_for_cpu(4)
    assert model.packed_lm_head is None
    with pytest.raises(RuntimeError, match="without its output head"):
        model.compute_logits(torch.zeros(1, config.hidden_size))


def test_a_stage_that_fails_after_building_its_engine_leaves_no_rank_running(tiny_qwen2_path):
    """create_service closes the engine it built when a later part fails: here the kv_events port is taken."""
    zmq = pytest.importorskip("zmq")
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://*")
    try:
        with pytest.raises(zmq.ZMQError):
            create_service({"model_path": tiny_qwen2_path, "device": "cpu", "dtype": "float32",
                            "num_kv_blocks": "8", "max_num_seqs": "4", "max_model_len": "128",
                            "tensor_parallel_size": "2", "kv_events": f"tcp://*:{port}"})
    finally:
        taken.close(linger=0)
    assert not [line for line in descendants(os.getpid()).values() if "spawn_main" in line]
