"""A response sink for LLMService tests: collects outputs and errors, signals when the request ended."""

from __future__ import annotations

import threading


class ListSink:
    """Implements omni_backend.stages.llm.outputs.ResponseSink in memory; set `cancelled` to simulate a client cancel."""

    def __init__(self):
        self.outputs = []
        self.errors = []
        self.cancelled = False
        self.closed = 0  # final flags sent without a response (after a cancellation)
        self.done = threading.Event()

    def send(self, output):
        self.outputs.append(output)
        if output.finished:
            self.done.set()

    def fail(self, message):
        self.errors.append(message)
        self.done.set()

    def close(self):
        self.closed += 1
        self.done.set()

    def is_cancelled(self):
        return self.cancelled
