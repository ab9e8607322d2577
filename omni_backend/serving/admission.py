"""Running a request's work while holding one of the front door's admission slots, and stopping it when the
client leaves."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response

from omni_backend.serving.sse import ReleasingEventSourceResponse


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def run_admitted(door, request: Request, work, start, stream_events=None, collect=None):
    """Run `work` (something with an async `close()`, e.g. a Generation) holding one of the front door's admission
    slots (429 when none is free).

    Awaits `start()` and then either streams `stream_events` (an async iterator of SSE events; the work is
    closed and the slot freed however the stream ends) or awaits `collect()` and returns its result (`start` and
    `collect`: functions returning coroutines, called only once the slot is held). Until then a client that
    leaves ends the work and gets a 499 response; any error closes the work and frees the slot before it
    propagates.

    Args:
        door: the FrontDoor (serving/front_door.py).

    Returns:
        the SSE Response, a 499 Response, or what `collect` returned.
    """
    admission = door.admitted()
    await admission.__aenter__()

    async def release() -> None:
        await work.close()
        await admission.__aexit__(None, None, None)

    try:
        await until_disconnect(request, start())
        if stream_events is not None:
            return ReleasingEventSourceResponse(stream_events, release=release, ping=15, sep="\n",
                                                shutdown_grace_s=door.config.graceful_shutdown_s)
        result = await until_disconnect(request, collect())
    except ClientGone:
        await release()
        return Response(status_code=499)
    except BaseException:
        await release()
        raise
    await admission.__aexit__(None, None, None)
    return result


async def until_disconnect(request: Request, work):
    """Await `work` (a coroutine) unless the client disconnects first; then cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - the cancelled work's outcome no longer matters
                pass
