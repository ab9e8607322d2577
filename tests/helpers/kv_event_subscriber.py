"""A ZMQ SUB socket on the llm stage's KV-event stream (vLLM's frames, msgpack payload), for the KV-event tests."""

from __future__ import annotations

import msgpack
import zmq


def subscriber(endpoint: str, bind: bool = False) -> zmq.Socket:
    """A SUB socket for every topic on `endpoint` (connected, or bound when the publisher connects)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    (sub.bind if bind else sub.connect)(endpoint)
    return sub


def receive(sub: zmq.Socket) -> tuple[bytes, int, list]:
    """One message: (topic, sequence number, decoded [ts, events, dp_rank]); zmq.Again after 10 s without one."""
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)


def until_subscribed(sub: zmq.Socket, send) -> int:
    """Call `send()` (which makes the publisher send one AllBlocksCleared batch) until the subscriber receives one:
    a PUB socket drops what it sends before the subscription has reached it. Returns the sequence number of the
    last such batch received (the next batch has the next number)."""
    for _ in range(100):
        send()
        if sub.poll(100):
            _, seq, (_, events, _) = receive(sub)
            assert events == [["AllBlocksCleared"]]
            while sub.poll(100):  # the later tries that got through too
                _, seq, _ = receive(sub)
            return seq
    raise AssertionError("the subscriber never received a batch")


def replay(held: set[int], events: list) -> set[int]:
    """What a subscriber knows the cache holds after `events` (wire form); a removal of an unknown block fails."""
    for event in events:
        if event[0] == "BlockStored":
            held |= set(event[1])
        elif event[0] == "BlockRemoved":
            assert set(event[1]) <= held, (event, held)
            held -= set(event[1])
        else:
            assert event == ["AllBlocksCleared"]
            held = set()
    return held
