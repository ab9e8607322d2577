"""vLLM's ZMQ stream of KV-cache events, published off the engine loop.

The wire form (vLLM's `ZmqEventPublisher`, which Dynamo's ZMQ relay and llm-d's KV-cache indexer subscribe to):
each batch is one ZMQ multipart message of three frames, [topic, sequence number as 8 bytes big-endian, msgpack
of [timestamp (Unix s, float), [event, ...], data-parallel rank]], on a PUB socket. The events are
`omni_backend.engine.kv_events`' (anything with a `wire()` list).

The engine loop only hands each step's events over (`publish`: a lock and an append); a daemon thread encodes and
sends them. The hand-over buffer holds at most MAX_PENDING_BATCHES batches: past that a batch is dropped and
counted (`num_dropped_events`, the metric `omni_kv_events_dropped_total`), never waited for. Sequence numbers are
given at hand-over, so a dropped batch leaves a gap a subscriber can see. A PUB socket itself drops messages for a
subscriber that is not connected yet or reads too slowly (ZMQ's high-water mark, SEND_HWM messages); that loss
shows as a gap too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import msgpack
import zmq

logger = logging.getLogger(__name__)

MAX_PENDING_BATCHES = 10_000
SEND_HWM = 100_000  # vLLM's default high-water mark for its publisher


def endpoint_for_rank(endpoint: str, data_parallel_rank: int) -> str:
    """The endpoint of data-parallel rank `data_parallel_rank`, as vLLM derives it: rank 0 keeps it, a tcp port
    goes up by the rank, an ipc or inproc name gets `_dp<rank>` (so several engines in one server never share a
    socket).

    Raises:
        ValueError: a tcp endpoint without a numeric port, or another transport.
    """
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"KV-event endpoint {endpoint!r} has no port")
        return f"{host}:{int(port) + data_parallel_rank}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    raise ValueError(f"KV-event endpoint {endpoint!r} is not tcp://, ipc:// or inproc://")


def binds(endpoint: str) -> bool:
    """vLLM's rule: the publisher binds an endpoint with a wildcard host (`*`, `::`) or an ipc/inproc one, and
    connects to any other (a central subscriber that binds, as llm-d's indexer does)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventStream:
    """A PUB socket and the thread that feeds it.

    Args:
        endpoint: ZMQ endpoint (`tcp://*:5557` binds, `tcp://host:5557` connects: `binds`), before the rank's
            offset (`endpoint_for_rank`).
        topic: the first frame of every message ("" : vLLM's default).
        data_parallel_rank: this engine's rank among the engines of one server (stages/llm/parameters.py,
            `place_instance`), sent in every batch.

    Attributes:
        endpoint: the endpoint in use (after the rank's offset).
        num_published_batches: batches sent; num_dropped_events: events dropped because the buffer was full.

    Raises:
        zmq.ZMQError: the endpoint cannot be bound or connected (taken port, malformed address).
    """

    def __init__(self, endpoint: str, topic: str = "", data_parallel_rank: int = 0):
        self.endpoint = endpoint_for_rank(endpoint, data_parallel_rank)
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode("utf-8")
        # created here so that a bad endpoint fails the stage's start; only the sender thread uses it afterwards
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(SEND_HWM)
        (self._socket.bind if binds(self.endpoint) else self._socket.connect)(self.endpoint)
        self._pending: deque[tuple[int, float, list]] = deque()
        self._ready = threading.Condition()
        self._next_seq = 0
        self._closing = False
        self.num_published_batches = 0
        self.num_dropped_events = 0
        self._thread = threading.Thread(target=self._send_loop, name="kv-event-stream", daemon=True)
        self._thread.start()

    def publish(self, events: list) -> None:
        """Hand over one step's events (nothing for an empty list); never blocks on the network."""
        if not events:
            return
        with self._ready:
            seq = self._next_seq
            self._next_seq += 1
            if len(self._pending) >= MAX_PENDING_BATCHES:
                self.num_dropped_events += len(events)
                return
            self._pending.append((seq, time.time(), events))
            self._ready.notify()

    def _send_loop(self) -> None:
        while True:
            with self._ready:
                while not self._pending and not self._closing:
                    self._ready.wait()
                if not self._pending:  # closing, and everything handed over was sent
                    return
                batches = list(self._pending)
                self._pending.clear()
            for seq, ts, events in batches:
                try:
                    payload = msgpack.packb([ts, [event.wire() for event in events], self.data_parallel_rank])
                    self._socket.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
                    self.num_published_batches += 1
                except Exception:  # one bad batch must not end the stream; its seq stays a gap
                    logger.exception("sending KV-event batch %d failed", seq)

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what was handed over (up to `timeout_s`), then close the socket."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        self._thread.join(timeout=timeout_s)
        if not self._thread.is_alive():  # else the sender still holds it; the process's exit ends both
            self._socket.close(linger=0)
