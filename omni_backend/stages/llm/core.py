"""The engine loop: one thread owns an LLMEngine, takes typed messages from its inbox and steps the engine.

The part of the llm stage that a second engine instance (a talker) or a distributed worker reuses as it is, in the
role of vLLM v1's `EngineCore` busy loop: messages in (`messages.py`), `(request id, RequestOutput | StageError)`
pairs out to `outbox`, and nothing else; who sends the outputs where is `outputs.OutputRouter`'s business.

The power/temperature governor (omni_backend/ops/governor.py) is consulted once per iteration: it sets the
scheduler's sequences-per-step limit. With a KV-event stream (ops/kv_event_stream.py), the prefix cache's events of
each iteration are handed to it at the iteration's end, as one batch. A step or an iteration that fails ends the
requests in flight with an INTERNAL error and the loop goes on, so one fault never hangs every client; but a failed
step of an engine with tensor-parallel ranks leaves the ranks out of step (`LLMEngine.out_of_service`): the loop
then fails every request it holds or is sent with UNAVAILABLE and ends, so the stage's heartbeat stops and it
reads not ready until it is restarted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from omni_backend.engine.llm_engine import LLMEngine, RequestOutput
from omni_backend.ops.governor import Governor
from omni_backend.stages.llm.loop import BackgroundLoop, drained
from omni_backend.stages.llm.messages import AbortRequest, AddRequest, ExtendInputs, InboxMessage, ResetPrefixCache
from omni_backend.vocabulary import BY_PARAM, ErrorKind, StageError

if TYPE_CHECKING:  # imported by build.py only when the kv_events setting asks for it (pyzmq, msgpack)
    from omni_backend.ops.kv_event_stream import KVEventStream

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # the longest an idle loop sleeps before looking at the governor again


class EngineCore(BackgroundLoop):
    """Runs `engine` on its own thread; only that thread touches the engine once `start` was called.

    Args:
        engine: the engine.
        governor: power/temperature governor of the engine's GPU (None: never limits).
        kv_events: where the block manager's KV events go (None: the block manager records none).

    Attributes:
        outbox: `(request id, RequestOutput | StageError)` in the order the loop produced them.
        refusal: the error every request gets once the engine is out of service (None while it serves).
        last_iteration: `time.monotonic()` when the loop last began an iteration (for the stage's heartbeat).
    """

    def __init__(self, engine: LLMEngine, governor: Governor | None = None, kv_events: KVEventStream | None = None):
        super().__init__("llm-engine-loop")
        self.engine = engine
        self.governor = governor
        self.kv_events = kv_events
        self._kv_recorder = engine.runner.block_manager.record_kv_events() if kv_events is not None else None
        self.outbox: queue.SimpleQueue[tuple[str, RequestOutput | StageError]] = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self.refusal: StageError | None = None
        # orders `put` against going out of service: a message is either drained by it or refused by `put`
        self._refusal_lock = threading.Lock()

    def put(self, message: InboxMessage) -> None:
        """Hand a message to the loop (it takes it before its next step); once the engine is out of service,
        refuse it here (`refusal`: a request's error goes to the outbox)."""
        with self._refusal_lock:
            if self.refusal is None:
                self._inbox.put(message)
                self._wakeup.set()
                return
        self._refuse(message)

    def wake(self) -> None:
        self._wakeup.set()

    def started(self) -> None:
        self.engine.runner.device.bind_thread()  # kernels launch on the current device (engine/device.py)

    def iterate(self) -> None:
        self.run_once()

    def failed(self, exc: Exception) -> None:
        logger.exception("engine loop iteration failed; failing the requests in flight", exc_info=exc)
        self._fail_all(StageError(ErrorKind.INTERNAL, "engine loop failed (see server log)"))

    def run_once(self) -> None:
        """One iteration: governor, inbox, one engine step (or a wait of up to IDLE_WAIT_S when idle, or when every
        request held waits for input rows: `LLMEngine.stalled`; a message ends the wait), then the iteration's KV
        events to the stream.

        The loop thread calls it; tests call it directly on a core that was not started.
        """
        try:
            self._step_once()
        finally:
            if self.kv_events is not None:
                self.kv_events.publish(self._kv_recorder.take())

    def _step_once(self) -> None:
        engine = self.engine
        if self.governor is not None and self.governor.enabled:
            limit = self.governor.tick(time.monotonic())
            if limit != engine.scheduler.num_seqs_limit:
                engine.scheduler.set_num_seqs_limit(limit)
        self.drain_inbox()
        if not engine.has_unfinished() or engine.stalled:
            self._wakeup.wait(timeout=IDLE_WAIT_S)
            self._wakeup.clear()
            engine.stalled = False  # the next step sees whether the messages that came let a request go on
            if not engine.has_unfinished():
                return
            self.drain_inbox()
        try:
            outputs = engine.step()
        except Exception:
            if engine.out_of_service is not None:  # no later step can be trusted: see the module docstring
                self._go_out_of_service(engine.out_of_service)
                return
            # otherwise a fault in one step must not take the stage down
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all(StageError(ErrorKind.INTERNAL, "engine step failed (see server log)"))
            return
        for output in outputs:
            if output.error_field is not None:  # the request's own setting (its guide): a client error
                field = BY_PARAM[output.error_field].tensor
                self.outbox.put((output.request_id, StageError(ErrorKind.INVALID_ARGUMENT,
                                                               f"{field} {output.error}", field)))
            elif output.finish_reason == "error":  # this request alone could not go on (engine.step says why)
                self.outbox.put((output.request_id, StageError(ErrorKind.INTERNAL, f"llm failed: {output.error}")))
            else:
                self.outbox.put((output.request_id, output))

    def drain_inbox(self) -> None:
        """Carry out every message waiting in the inbox, in order."""
        for message in drained(self._inbox):
            if isinstance(message, AddRequest):
                try:
                    self.engine.add_sequence(message.sequence)
                except ValueError as exc:
                    self.outbox.put((message.sequence.request_id, StageError.of(exc, "llm")))
            elif isinstance(message, AbortRequest):
                output = self.engine.abort(message.request_id)
                if output is not None:
                    self.outbox.put((message.request_id, output))
            elif isinstance(message, ExtendInputs):
                try:
                    self.engine.extend_inputs(message.request_id, message.rows, message.tail)
                except ValueError as exc:  # this request's rows are wrong: it ends, the others go on
                    self.engine.abort(message.request_id)
                    self.outbox.put((message.request_id, StageError.of(exc, "llm")))
            elif isinstance(message, ResetPrefixCache):
                message.done.set_result(self.engine.runner.block_manager.reset_prefix_cache())
            else:
                raise TypeError(f"not an inbox message: {message!r}")

    def _go_out_of_service(self, reason: str) -> None:
        logger.exception("the llm engine is out of service (%s): failing its requests and ending its loop; the "
                         "stage must be restarted", reason)
        error = StageError(ErrorKind.UNAVAILABLE, f"llm engine out of service ({reason}); the stage must be "
                                                  "restarted")
        self._fail_all(error)
        with self._refusal_lock:
            self.refusal = error
            messages = list(drained(self._inbox))
        for message in messages:
            self._refuse(message)
        self.stop()

    def _refuse(self, message: InboxMessage) -> None:
        """Answer `message` with `refusal` (a request's error, a reset's exception); aborts and input rows are
        moot."""
        if isinstance(message, AddRequest):
            self.outbox.put((message.sequence.request_id, self.refusal))
        elif isinstance(message, ResetPrefixCache):
            message.done.set_exception(self.refusal)

    def _fail_all(self, error: StageError) -> None:
        for request_id in list(self.engine.requests):
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("aborting %s failed", request_id)
            self.outbox.put((request_id, error))
