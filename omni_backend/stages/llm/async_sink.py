"""One request's outputs as an asyncio stream, for in-process callers of an `LLMService` (a Dynamo worker).

The service's response thread calls the sink (`outputs.ResponseSink`): each call appends the item to the sink's
waiting list, and the first item after the reader last found the list empty wakes the reader's event loop
(`loop.call_soon_threadsafe`); items that arrive while a wake-up is on its way ride along with it. The reader
takes everything waiting at once and joins consecutive unfinished outputs into one delta
(`RequestOutput.followed_by`), so a reader that falls behind the engine (Dynamo's response stream costs a message
per yield, whatever its size) catches up with one larger chunk instead of a backlog of one-token ones, as vLLM's
Dynamo worker yields whatever accumulated since its last yield. Cancellation goes the other way: the caller marks
the sink cancelled (`cancel`; or the probe it was given says so, e.g. Dynamo's `context.is_stopped`), the response
thread sees it at its next cancel poll, aborts the request in the engine (its KV blocks are freed) and closes the
stream.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable

from omni_backend.engine.llm_engine import RequestOutput
from omni_backend.vocabulary import StageError

_END = object()  # the stream ended without a final output (cancelled)


class AsyncSink:
    """A `ResponseSink` read with `async for output in sink` on `loop`.

    Args:
        loop: the event loop the reader runs on.
        stopped: a probe, True once the reader's client went away (called from the response thread); None: only
            `cancel` cancels.

    Iteration yields the request's `RequestOutput`s up to its final one (finish_reason set), each the join of the
    deltas that arrived since the reader's previous step (their tokens in order), and raises the `StageError` the
    service failed it with; a cancelled stream ends without a final output.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, stopped: Callable[[], bool] | None = None):
        self._loop = loop
        self._lock = threading.Lock()
        self._arrived: list = []  # handed over by the response thread, not yet taken; under `_lock`
        self._wakeup_sent = False  # a wake-up is on its way to the loop; under `_lock`
        self._ready = asyncio.Event()
        self._taken: collections.deque = collections.deque()  # the reader's, taken from `_arrived`
        self._stopped = stopped
        self._cancelled = False
        self._done = False

    def cancel(self) -> None:
        """Ask for the request to end (its reader stops reading); the response thread aborts it soon."""
        self._cancelled = True

    # the response thread's side (outputs.ResponseSink)
    def send(self, output: RequestOutput) -> None:
        self._put(output)

    def fail(self, error: StageError) -> None:
        self._put(error)

    def close(self) -> None:
        self._put(_END)

    def is_cancelled(self) -> bool:
        return self._cancelled or (self._stopped is not None and self._stopped())

    def _put(self, item: object) -> None:
        with self._lock:
            self._arrived.append(item)
            if self._wakeup_sent:
                return
            self._wakeup_sent = True
        self._loop.call_soon_threadsafe(self._ready.set)

    # the reader's side
    def __aiter__(self) -> AsyncSink:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while not self._taken:
            with self._lock:
                self._taken.extend(self._arrived)
                self._arrived.clear()
                if not self._taken:
                    self._wakeup_sent = False
            if not self._taken:
                # the set of a wake-up sent after this point runs on this loop, so after the clear
                self._ready.clear()
                await self._ready.wait()
        item = self._taken.popleft()
        while isinstance(item, RequestOutput) and not item.finished and self._taken \
                and isinstance(self._taken[0], RequestOutput):
            item = item.followed_by(self._taken.popleft())
        if item is _END:
            self._done = True
            raise StopAsyncIteration
        if isinstance(item, StageError):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item
