"""The response thread: routes the engine loop's outputs to each request's sink and polls for cancellations.

vLLM v1's `output_processor.py` in the llm stage. Triton's `sender.send` and `is_cancelled` are IPC round trips to
the server; keeping them off the engine loop (as Triton's vLLM backend does with its response thread) lets the loop
go straight from one step to the next while responses stream out. When sending falls behind the engine, a
request's waiting deltas are joined into one (`take_outbox`), so clients get the same text in fewer, larger chunks
instead of a growing backlog.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Callable, Protocol

from omni_backend.engine.llm_engine import RequestOutput
from omni_backend.ops.metrics import FinishedRequest
from omni_backend.stages.llm.cancel_board import CancelBoard
from omni_backend.stages.llm.loop import BackgroundLoop, drained
from omni_backend.vocabulary import StageError

logger = logging.getLogger(__name__)

CANCEL_POLL_INTERVAL_S = 0.05
# `is_cancelled` is an IPC round trip per request: with many streams on a busy CPU a round of polls can take
# tens of ms, so rounds are spaced at least this many times their own duration (polling <= 1/5 of the thread).
CANCEL_POLL_SPACING = 4


class ResponseSink(Protocol):
    """Where one request's outputs go (a Triton response sender in production, a list in tests)."""

    def send(self, output: RequestOutput) -> None: ...

    def fail(self, error: StageError) -> None: ...

    def close(self) -> None:
        """End the stream without a response (the final flag alone), after a cancellation."""

    def is_cancelled(self) -> bool: ...


class OutputRouter(BackgroundLoop):
    """The sinks of the requests a service holds, and the thread that feeds them.

    Args:
        outbox: the engine loop's `(request id, RequestOutput | StageError)` pairs (`EngineCore.outbox`).
        abort: asks the engine loop to abort a request (called for a cancelled client or a failed send).
        note_finished: whether finished requests' timings are kept for the metrics thread (`take_finished`).
        board: where cancels by key that found no held request wait for it (`cancel_board.CancelBoard`; default:
            this process only).

    Attributes:
        last_iteration: `time.monotonic()` when the thread last began an iteration (for the stage's heartbeat).
    """

    def __init__(self, outbox: queue.SimpleQueue, abort: Callable[[str], None], note_finished: bool = False,
                 board: CancelBoard | None = None):
        super().__init__("llm-responses")
        self.board = board if board is not None else CancelBoard()
        self.outbox = outbox
        self.abort = abort
        self.note_finished = note_finished
        self.lock = threading.Lock()
        self._sinks: dict[str, ResponseSink] = {}
        self._submitted: dict[str, float] = {}  # request id -> time.monotonic() at submit; under `lock`
        self._finished: collections.deque[FinishedRequest] = collections.deque()
        self._cancels: queue.SimpleQueue[str] = queue.SimpleQueue()  # request ids `cancel` was asked for
        self._next_poll = time.monotonic()

    @property
    def num_held(self) -> int:
        """Requests whose streams have not ended."""
        with self.lock:
            return len(self._sinks)

    def held(self) -> list[str]:
        """The ids of the requests whose streams have not ended."""
        with self.lock:
            return list(self._sinks)

    def holds_locked(self, request_id: str) -> bool:
        """Whether the request is held; call with `lock` held."""
        return request_id in self._sinks

    def num_held_locked(self) -> int:
        """`num_held`; call with `lock` held."""
        return len(self._sinks)

    def add_locked(self, request_id: str, sink: ResponseSink, submitted: float) -> None:
        """Hold a new request's sink; call with `lock` held, after `holds_locked` said it is not held."""
        self._sinks[request_id] = sink
        self._submitted[request_id] = submitted

    def take_finished(self) -> list[FinishedRequest]:
        """The timings of the requests finished since the previous call."""
        finished = []
        while self._finished:
            finished.append(self._finished.popleft())
        return finished

    def fail_all(self, error: StageError) -> None:
        """End every held stream with `error` (shutdown)."""
        with self.lock:
            sinks, self._sinks = self._sinks, {}
            self._submitted.clear()
        for sink in sinks.values():
            try:
                sink.fail(error)
            except Exception:
                logger.exception("failing a request failed")

    def cancel(self, request_id: str) -> None:
        """End a held request as a cancelled client's (`end_stream`), on this thread's next iteration."""
        self._cancels.put(request_id)

    def iterate(self) -> None:
        for request_id, item in self.take_outbox():
            try:  # one failing delivery must not drop the others taken with it
                self.deliver(request_id, item)
            except Exception:
                logger.exception("delivering a response for %s failed", request_id)
        self.take_cancels()
        if time.monotonic() >= self._next_poll:
            began = time.monotonic()
            for request_id in self.board.claim(self.held()):
                self.cancel(request_id)
            self.poll_cancellations()
            took = time.monotonic() - began
            self._next_poll = began + took + max(CANCEL_POLL_INTERVAL_S, CANCEL_POLL_SPACING * took)

    def take_outbox(self) -> list[tuple[str, RequestOutput | StageError]]:
        """Everything in the outbox (waiting up to the cancellation poll interval for the first item), with each
        request's consecutive unfinished outputs joined into one delta (a response costs an IPC round trip
        whatever its size)."""
        try:
            items = [self.outbox.get(timeout=CANCEL_POLL_INTERVAL_S)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self.outbox.get_nowait())
            except queue.Empty:
                break
        joined: list[tuple[str, RequestOutput | StageError]] = []
        open_output: dict[str, int] = {}  # request id -> index in `joined` of its unfinished output
        for request_id, item in items:
            index = open_output.pop(request_id, None)
            if index is not None and isinstance(item, RequestOutput):
                joined[index] = (request_id, joined[index][1].followed_by(item))
            else:
                index = len(joined)
                joined.append((request_id, item))
            if isinstance(joined[index][1], RequestOutput) and not joined[index][1].finished:
                open_output[request_id] = index
        return joined

    def deliver(self, request_id: str, item: RequestOutput | StageError) -> None:
        """Send one output (or error) to its request's sink; a request that ends drops its sink. A send that
        fails means the client went away: the request is aborted and its stream ended as a cancel."""
        submitted = None
        failed = isinstance(item, StageError)
        with self.lock:
            sink = self._sinks.get(request_id)
            finished = failed or item.finished
            if finished:
                self._sinks.pop(request_id, None)
                submitted = self._submitted.pop(request_id, None)
        if sink is not None:
            try:
                if failed:
                    sink.fail(item)
                else:
                    sink.send(item)
            except Exception:
                logger.exception("sending a response for %s failed; aborting it", request_id)
                if not finished:
                    self.end_stream(request_id, sink)
        if submitted is not None and not failed and self.note_finished:
            self._finished.append(_finished_request(item, submitted, time.monotonic()))

    def take_cancels(self) -> None:
        """End the requests `cancel` was asked for since the last look; a cancel whose request is not held goes to
        the board, for a generation that arrives later or that another llm instance holds."""
        for request_id in drained(self._cancels):
            with self.lock:
                sink = self._sinks.get(request_id)
            if sink is not None:
                self.end_stream(request_id, sink)
            else:
                self.board.post(request_id)

    def poll_cancellations(self) -> None:
        """Abort cancelled requests and end their streams with the final flag (`sink.close`).

        python_backend's contract is that a decoupled model still sends the final flag for a cancelled request;
        without it Triton 2.51 never releases the request's gRPC state (measured: tritonserver grew ~31 KiB per
        cancelled llm stream, without end) and keeps the model "live" at shutdown. The sink is dropped before the
        flag is sent, and this thread is the only one sending on admitted requests, so nothing is sent after it:
        the request's outputs still queued find no sink in `deliver`."""
        with self.lock:
            sinks = list(self._sinks.items())
        for request_id, sink in sinks:
            try:
                cancelled = sink.is_cancelled()
            except Exception:  # a sender that cannot answer has no client left to answer to
                logger.exception("asking whether %s was cancelled failed; ending it", request_id)
                cancelled = True
            if cancelled:
                self.end_stream(request_id, sink)

    def end_stream(self, request_id: str, sink: ResponseSink) -> None:
        """Drop the request's sink, abort it and send its final flag alone (`sink.close`); nothing is sent after."""
        with self.lock:
            self._sinks.pop(request_id, None)
            self._submitted.pop(request_id, None)
        self.abort(request_id)
        try:
            sink.close()
        except Exception:  # the stream is gone either way
            logger.exception("ending the request %s failed", request_id)


def _finished_request(output: RequestOutput, submitted: float, now: float) -> FinishedRequest:
    """Timings of a finished request, measured from its arrival at this stage (`submit`)."""
    return FinishedRequest(
        prompt_tokens=output.prompt_tokens, completion_tokens=output.completion_tokens, e2e_s=now - submitted,
        ttft_s=output.first_token_time - submitted if output.first_token_time is not None else None,
        queue_s=output.first_scheduled_time - submitted if output.first_scheduled_time is not None else None,
    )
