"""A ZMQ SUB socket on the llm stage's KV-event stream (vLLM's frames, msgpack payload), for the KV-event tests."""

from __future__ import annotations

import msgpack
import zmq

PROBE = [["AllBlocksCleared"]]  # the batch a subscription probe makes the publisher send


class KVEventSubscriber:
    """A SUB socket for every topic on `endpoint` (connected, or bound when the publisher connects).

    A PUB socket drops what it sends before a subscription has reached it, so a test first probes (`subscribe`)
    and then reads the batches its own actions cause (`receive`). Probes sent before the first one got through may
    still arrive after it (late on a loaded machine), but always before any later batch: `receive` skips them
    until the first other batch, so a test's first batch after `subscribe` must not be a lone AllBlocksCleared.

    Attributes:
        last_probe: the sequence number of the last probe received (the test's batches follow it).
    """

    def __init__(self, endpoint: str, bind: bool = False):
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.RCVTIMEO, 10_000)
        (self.socket.bind if bind else self.socket.connect)(endpoint)
        self.last_probe: int | None = None
        self._past_probes = True  # until `subscribe`

    def subscribe(self, send) -> None:
        """Call `send()` (which makes the publisher send one AllBlocksCleared batch) until a probe arrives."""
        for _ in range(100):
            send()
            if self.socket.poll(100):
                _, self.last_probe, (_, events, _) = self._receive()
                assert events == PROBE
                self._past_probes = False
                return
        raise AssertionError("the subscriber never received a batch")

    def receive(self) -> tuple[bytes, int, list]:
        """The next batch after the probes: (topic, sequence number, decoded [ts, events, dp_rank]); zmq.Again
        after 10 s without one."""
        while True:
            topic, seq, batch = self._receive()
            if self._past_probes or batch[1] != PROBE:
                self._past_probes = True
                return topic, seq, batch
            self.last_probe = seq

    def _receive(self) -> tuple[bytes, int, list]:
        topic, seq, payload = self.socket.recv_multipart()
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)

    def close(self) -> None:
        self.socket.close(linger=0)


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
