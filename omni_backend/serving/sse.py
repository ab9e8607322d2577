"""Server-sent-event responses whose cleanup runs however the response ends."""

from __future__ import annotations

from sse_starlette import EventSourceResponse


class ReleasingEventSourceResponse(EventSourceResponse):
    """An SSE response that calls `release` when it ends, however it ends (finished, client gone, cancelled).

    Cleanup in the body generator's `finally` alone is not enough: a generator that never started (the client
    left before the first read) never runs it, and the request would keep its concurrency slot and streams.

    Shutdown: sse-starlette ends every stream as soon as uvicorn gets SIGTERM/SIGINT unless a grace period is
    given; `shutdown_grace_s` lets a stream in flight run on for up to that many seconds (uvicorn's
    `timeout_graceful_shutdown` should be the same: it stops waiting for connections then).
    """

    def __init__(self, content, release, *, shutdown_grace_s: float, **kwargs):
        super().__init__(content, shutdown_grace_period=shutdown_grace_s, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._release()
