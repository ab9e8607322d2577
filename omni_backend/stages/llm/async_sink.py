"""One request's outputs as an asyncio stream, for in-process callers of an `LLMService` (a Dynamo worker).

The service's response thread calls the sink (`outputs.ResponseSink`): each call hands the item to the caller's
event loop (`loop.call_soon_threadsafe`), where `__anext__` takes them in order. Cancellation goes the other way:
the caller marks the sink cancelled (`cancel`; or the probe it was given says so, e.g. Dynamo's
`context.is_stopped`), the response thread sees it at its next cancel poll, aborts the request in the engine (its KV
blocks are freed) and closes the stream.
"""

from __future__ import annotations

import asyncio
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

    Iteration yields the request's `RequestOutput`s up to its final one (finish_reason set), and raises the
    `StageError` the service failed it with; a cancelled stream ends without a final output.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, stopped: Callable[[], bool] | None = None):
        self._loop = loop
        self._items: asyncio.Queue = asyncio.Queue()
        self._stopped = stopped
        self._cancelled = False
        self._done = False

    def cancel(self) -> None:
        """Ask for the request to end (its reader stops reading); the response thread aborts it soon."""
        self._cancelled = True

    # the response thread's side (outputs.ResponseSink)
    def send(self, output: RequestOutput) -> None:
        self._loop.call_soon_threadsafe(self._items.put_nowait, output)

    def fail(self, error: StageError) -> None:
        self._loop.call_soon_threadsafe(self._items.put_nowait, error)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._items.put_nowait, _END)

    def is_cancelled(self) -> bool:
        return self._cancelled or (self._stopped is not None and self._stopped())

    # the reader's side
    def __aiter__(self) -> AsyncSink:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._items.get()
        if item is _END:
            self._done = True
            raise StopAsyncIteration
        if isinstance(item, StageError):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item
