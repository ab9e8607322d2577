"""Ends every held request in time when tritonserver stops, so that it exits cleanly.

tritonserver keeps the model loaded while requests it accepted still stream, but when its `--exit-timeout-secs` runs
out with a decoupled request in flight, 2.51 crashes in its teardown (signal 11/6 seen) and hangs without answering
those clients. So while requests are held a watch thread asks every STOP_POLL_INTERVAL_S whether the server is
stopping (`server_probe.parent_server_probe`); from then on requests get `grace_s` (the exit timeout less
STOP_MARGIN_S) to finish, and those still held are aborted (finish reason "abort"), so the server exits cleanly and
every client gets an ending. Measured with an exit timeout of 8 s: the shutdown seen within 0.5 s, the abort at
+5 s, exit status 0 at about +7 s (tests/reliability/test_shutdown.py).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from omni_backend.stages.llm.loop import BackgroundLoop

logger = logging.getLogger(__name__)

STOP_POLL_INTERVAL_S = 0.5  # how often the watch thread asks whether the server is stopping
STOP_MARGIN_S = 3.0  # aborting, the last responses and unloading must fit between the abort and the exit timeout


class StopWatch(BackgroundLoop):
    """Watches the server while requests are held and aborts them `grace_s` after it starts stopping.

    Args:
        stopping: probe, True once the server is shutting down or unloading the model; it may raise (an unknown
            answer, asked again later).
        grace_s: seconds requests may run on after `stopping` first says True (after it has said False at least
            once: a probe that never works never aborts anything).
        held: the ids of the requests held now.
        abort: ends one request (finish reason "abort").

    Attributes:
        deadline: `time.monotonic()` when held requests are aborted, None while the server is not stopping.
    """

    def __init__(self, stopping: Callable[[], bool], grace_s: float, held: Callable[[], list[str]],
                 abort: Callable[[str], None]):
        super().__init__("llm-stop-watch", STOP_POLL_INTERVAL_S)
        self.server_stopping, self.grace_s = stopping, grace_s
        self.held, self.abort = held, abort
        self.deadline: float | None = None
        self._seen_ready = False
        self._probe_failed = False  # the traceback of a failing probe is logged once
        self._aborted: set[str] = set()

    def iterate(self) -> None:
        self.look()

    def look(self) -> None:
        """One look: while requests are held (and, until the server has once said it is not stopping, also while
        idle), ask `stopping`; `grace_s` after it first says the server is stopping, abort every request still
        held. Its own thread: a slow probe never holds up responses."""
        now = time.monotonic()
        held = self.held()
        if not held and self._seen_ready:
            return
        if self.deadline is None or now < self.deadline:  # during the grace too: a false alarm clears
            try:
                stopping = self.server_stopping()
            except Exception:  # an unknown answer: ask again later, change nothing
                logger.warning("asking whether the server is stopping failed", exc_info=not self._probe_failed)
                self._probe_failed = True
                return
            if not stopping:
                if self.deadline is not None:
                    logger.warning("the server answers again: not stopping after all")
                self._seen_ready, self.deadline = True, None
                return
            if not self._seen_ready:
                return
            if self.deadline is None:
                self.deadline = now + self.grace_s
                logger.warning("the server is stopping with %d requests in flight; those still running in %.1f s "
                               "are aborted so that it exits within its exit timeout", len(held), self.grace_s)
            if now < self.deadline:
                return
        late = [request_id for request_id in held if request_id not in self._aborted]
        for request_id in late:
            self._aborted.add(request_id)
            self.abort(request_id)
        if late:
            logger.warning("aborted %d requests still running at the server's exit timeout", len(late))
