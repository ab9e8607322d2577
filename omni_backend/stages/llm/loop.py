"""The llm stage's background threads share one shape: a daemon thread calling `iterate` until stopped."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Iterator, TypeVar

Item = TypeVar("Item")

logger = logging.getLogger(__name__)


def drained(items: queue.SimpleQueue[Item]) -> Iterator[Item]:
    """What is in `items` now, taken in order without waiting."""
    while True:
        try:
            yield items.get_nowait()
        except queue.Empty:
            return


class BackgroundLoop:
    """A daemon thread that calls `iterate()` until `stop()`, `interval_s` apart (0: back to back). An exception in
    one iteration goes to `failed` (logged by default) and the loop goes on: the stage's threads must outlive any
    fault, or every request in flight would hang.

    Attributes:
        last_iteration: `time.monotonic()` when the loop last began an iteration (the stage's heartbeat reads it).
    """

    def __init__(self, name: str, interval_s: float = 0.0):
        self.interval_s = interval_s
        self.last_iteration = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the loop to end after its current iteration, and wait for it up to `timeout_s` (no wait when the
        loop's own thread asks)."""
        self._stop.set()
        self.wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)

    @property
    def alive(self) -> bool:
        """Whether the loop's thread still runs (started and not ended)."""
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the loop's thread to end."""
        self._thread.join(timeout=timeout_s)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wake(self) -> None:
        """Cut a wait inside `iterate` short (subclasses that wait on an event of their own override it)."""

    def started(self) -> None:
        """Called once on the loop's thread before its first iteration."""

    def iterate(self) -> None:
        raise NotImplementedError

    def failed(self, exc: Exception) -> None:
        logger.exception("%s: an iteration failed", self._thread.name, exc_info=exc)

    def _run(self) -> None:
        self.started()
        while not self._stop.is_set():
            self.last_iteration = time.monotonic()
            try:
                self.iterate()
            except Exception as exc:
                self.failed(exc)
            if self.interval_s and self._stop.wait(self.interval_s):
                break
