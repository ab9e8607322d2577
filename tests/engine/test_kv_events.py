"""KV events of the prefix cache (engine/kv_events.py, ops/kv_event_stream.py): what the block manager records for
blocks named, evicted and cleared, replayed against the cache's own state; the same events decoded from vLLM's ZMQ
stream with a SUB socket and msgpack, from the stream alone and from the llm stage's service; and that nothing is
recorded or started while the `kv_events` setting is empty (the default)."""

from __future__ import annotations

import pytest
from helpers.kv_event_subscriber import KVEventSubscriber, replay
from helpers.list_sink import ListSink

from omni_backend.engine.block_manager import BlockManager, BlockTablePool
from omni_backend.engine.device import Device
from omni_backend.engine.kv_events import AllBlocksCleared, external_hash
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import Sequence
from omni_backend.launch.ports import free_ports
from omni_backend.ops.kv_event_stream import KVEventStream, endpoint_for_rank
from omni_backend.stages.llm.build import create_service
from omni_backend.stages.llm.parameters import LLMStageSettings

BLOCK_SIZE = 16
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def _manager(num_blocks: int) -> BlockManager:
    manager = BlockManager(num_blocks, BLOCK_SIZE, BlockTablePool(8, 16, Device("cpu")))
    manager.record_kv_events()
    return manager


def _computed(manager: BlockManager, name: str, token_ids: list[int]) -> Sequence:
    """A sequence admitted with what the cache offers, computed whole and offered to the cache (still held)."""
    seq = Sequence(name, token_ids, PARAMS, 0.0)
    manager.allocate(seq, len(seq), manager.cached_prefix(seq))
    seq.num_computed_tokens = len(seq)
    manager.register_computed_blocks(seq)
    return seq


def _wire(manager: BlockManager) -> list:
    return [event.wire() for event in manager.kv_events.take()]


def _cached(manager: BlockManager) -> set[int]:
    return {external_hash(name) for name in manager._by_name}


def test_the_64_bit_hash_is_the_names_low_64_bits():
    name = bytes(range(16))
    assert external_hash(name) == int.from_bytes(name, "big") & (2**64 - 1) == 0x08090A0B0C0D0E0F


def test_stored_evicted_and_cleared_blocks_are_events_that_replay_to_the_caches_state():
    manager = _manager(num_blocks=10)
    prompt = list(range(100, 140))  # blocks 0 and 1 full, block 2 holds 8 tokens
    a = _computed(manager, "a", prompt)
    h = [external_hash(n) for n in a.block_hashes]
    events = _wire(manager)
    assert events == [["BlockStored", h[:2], None, prompt[:32], BLOCK_SIZE, None, None, None]]
    held = replay(set(), events)
    assert held == _cached(manager) and len(held) == 2

    # b shares block 0 (taken from the cache: no event) and stores its own block 1 under a's block 0
    b_prompt = prompt[:16] + list(range(300, 330))
    b = _computed(manager, "b", b_prompt)
    assert b.block_table[0] == a.block_table[0]
    events = _wire(manager)
    assert events == [["BlockStored", [external_hash(b.block_hashes[1])], h[0], b_prompt[16:32], BLOCK_SIZE,
                       None, None, None]]
    held = replay(held, events)
    assert held == _cached(manager)

    # c computes a's content again while a holds it: its copies stay unnamed (no event) up to where it differs;
    # its third block is new and is stored on its own, its parent a's block 1
    c_prompt = prompt[:32] + list(range(500, 520))
    c = Sequence("c", c_prompt, PARAMS, 0.0)
    manager.allocate(c, len(c))  # no cache lookup: as if admitted before a's blocks were named
    c.num_computed_tokens = len(c)
    manager.register_computed_blocks(c)
    events = _wire(manager)
    assert events == [["BlockStored", [external_hash(c.block_hashes[2])], h[1], c_prompt[32:48], BLOCK_SIZE,
                       None, None, None]]
    held = replay(held, events)
    assert held == _cached(manager)

    # every block freed (named ones evictable), then a request that needs all ten: the named ones are evicted
    # least recently freed first, in one BlockRemoved
    for seq in (a, b, c):
        manager.free(seq)
    named_before = set(manager._by_name)
    d = Sequence("d", list(range(700, 860)), PARAMS, 0.0)
    manager.allocate(d, len(d))
    events = _wire(manager)
    assert len(events) == 1 and events[0][0] == "BlockRemoved" and events[0][2] is None
    assert {external_hash(n) for n in named_before} == set(events[0][1])
    held = replay(held, events)
    assert held == _cached(manager) == set()

    d.num_computed_tokens = len(d)
    manager.register_computed_blocks(d)
    held = replay(held, _wire(manager))
    assert held == _cached(manager) and len(held) == 10
    assert manager.reset_prefix_cache() == 10
    events = _wire(manager)
    assert events == [["AllBlocksCleared"]]
    assert replay(held, events) == _cached(manager) == set()


def test_a_sequence_running_across_a_reset_stores_its_whole_chain_again_from_its_first_block():
    """After AllBlocksCleared a subscriber holds nothing: a BlockStored whose parent it was told to forget would be
    dropped (vLLM's and Dynamo's indexers), so a running sequence names its blocks again from the first, parent
    None; another sequence sharing that first block stores only its own blocks, under it."""
    manager = _manager(num_blocks=12)
    prompt = list(range(100, 140))  # 2 full blocks
    a = _computed(manager, "a", prompt)
    b_prompt = prompt[:16] + list(range(300, 330))  # shares a's block 0 from the cache, then its own block 1
    b = _computed(manager, "b", b_prompt)
    held = replay(set(), _wire(manager))
    assert manager.reset_prefix_cache() == 3
    held = replay(held, _wire(manager))
    assert held == _cached(manager) == set()

    # a decodes 24 more tokens (4 full blocks now), b 1 more (still 2): both step after the reset
    for seq, more in ((a, 24), (b, 1)):
        seq.token_ids += list(range(900, 900 + more))
        manager.allocate(seq, len(seq))
        seq.num_computed_tokens = len(seq)
        manager.register_computed_blocks(seq)
    events = _wire(manager)
    assert events == [["BlockStored", [external_hash(n) for n in a.block_hashes[:4]], None, a.token_ids[:64],
                       BLOCK_SIZE, None, None, None],
                      ["BlockStored", [external_hash(b.block_hashes[1])], external_hash(a.block_hashes[0]),
                       b_prompt[16:32], BLOCK_SIZE, None, None, None]]
    held = replay(held, events)
    assert held == _cached(manager) and len(held) == 5
    # the next step stores only the new block, under the last one stored
    a.token_ids += list(range(950, 966))
    manager.allocate(a, len(a))
    a.num_computed_tokens = len(a)
    manager.register_computed_blocks(a)
    assert _wire(manager) == [["BlockStored", [external_hash(a.block_hashes[4])], external_hash(a.block_hashes[3]),
                               a.token_ids[64:80], BLOCK_SIZE, None, None, None]]


def test_nothing_is_recorded_by_default():
    assert LLMStageSettings().kv_events == ""
    manager = BlockManager(4, BLOCK_SIZE, BlockTablePool(8, 16, Device("cpu")))
    seq = _computed(manager, "a", list(range(40)))
    manager.free(seq)
    manager.reset_prefix_cache()
    assert manager.kv_events is None


def test_each_data_parallel_rank_gets_its_own_endpoint():
    assert endpoint_for_rank("tcp://*:5557", 0) == "tcp://*:5557"
    assert endpoint_for_rank("tcp://*:5557", 3) == "tcp://*:5560"
    assert endpoint_for_rank("ipc:///run/kv", 1) == "ipc:///run/kv_dp1"
    with pytest.raises(ValueError, match="no port"):
        endpoint_for_rank("tcp://host", 1)


def test_the_stream_sends_vllms_frames_with_increasing_sequence_numbers():
    (port,) = free_ports(1)
    endpoint = f"tcp://127.0.0.1:{port}"
    sub = KVEventSubscriber(endpoint, bind=True)  # a host:port endpoint: the stream connects, as to llm-d's indexer
    stream = KVEventStream(endpoint, topic="kv@pod-1@tiny", data_parallel_rank=0)
    try:
        sub.subscribe(lambda: stream.publish([AllBlocksCleared()]))
        manager = _manager(num_blocks=8)
        _computed(manager, "a", list(range(100, 140)))
        stream.publish(manager.kv_events.take())
        stream.publish([])  # an empty step sends nothing
        manager.reset_prefix_cache()
        stream.publish(manager.kv_events.take())
        received = [sub.receive() for _ in range(2)]
        assert [seq for _, seq, _ in received] == [sub.last_probe + 1, sub.last_probe + 2]
        assert {topic for topic, _, _ in received} == {b"kv@pod-1@tiny"}
        (ts1, stored, rank1), (ts2, cleared, rank2) = (batch for _, _, batch in received)
        assert rank1 == rank2 == 0 and 0 < ts1 <= ts2
        assert stored[0][0] == "BlockStored" and len(stored[0][1]) == 2 and cleared == [["AllBlocksCleared"]]
        assert stream.num_dropped_events == 0
    finally:
        stream.close()
        sub.close()


def test_the_llm_stage_publishes_its_caches_events_when_the_setting_names_an_endpoint(tiny_qwen2_path, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv-events"
    service = create_service({"model_path": tiny_qwen2_path, "device": "cpu", "dtype": "float32",
                              "num_kv_blocks": "8", "max_num_seqs": "4", "max_model_len": "128",
                              "kv_events": endpoint, "kv_events_topic": "kv@pod@tiny"})
    manager = service.engine.runner.block_manager
    sub = KVEventSubscriber(endpoint)
    service.start()
    held, seqs, kinds = set(), [], set()

    def receive_until_held_is_cached() -> None:
        """Read batches until the replayed events say what the (idle) engine's cache holds."""
        nonlocal held
        while held != _cached(manager):
            topic, seq, (_, events, rank) = sub.receive()
            assert (topic, rank) == (b"kv@pod@tiny", 0)
            seqs.append(seq)
            kinds.update(event[0] for event in events)
            held = replay(held, events)

    try:
        sub.subscribe(lambda: service.reset_prefix_cache().result(10))
        # 8 blocks of 16 tokens: each 70-token prompt (+4 generated) names 4 blocks; the second and third evict
        for i in range(3):
            sink = ListSink()
            prompt = [(i * 97 + k) % 1000 + 10 for k in range(70)]
            service.submit(f"p{i}", prompt, SamplingParams(max_tokens=4, ignore_eos=True), sink)
            assert sink.done.wait(30) and not sink.errors
            receive_until_held_is_cached()  # the request ended: its blocks are named and freed, the loop is idle
            assert len(held) >= 4
        assert service.reset_prefix_cache().result(10) == len(held)
        receive_until_held_is_cached()
        assert held == set() and kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
        # one batch per loop iteration, none lost
        assert seqs == list(range(sub.last_probe + 1, sub.last_probe + 1 + len(seqs)))
        assert service.core.kv_events.num_dropped_events == 0
    finally:
        service.shutdown()
        sub.close()


def test_the_llm_stage_starts_no_stream_without_the_setting(tiny_qwen2_path):
    service = create_service({"model_path": tiny_qwen2_path, "device": "cpu", "dtype": "float32",
                              "num_kv_blocks": "8", "max_model_len": "128"})
    assert service.core.kv_events is None and service.engine.runner.block_manager.kv_events is None
