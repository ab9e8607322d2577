"""The `llm` stage: an LLMEngine driven by one engine-loop thread, with responses sent from another thread.

Triton's Python backend calls `execute` on one thread; `sender.send` and `is_cancelled` are IPC round trips to
the server. Keeping them off the engine loop (as Triton's vLLM backend does with its response thread) lets the
loop go straight from one step to the next while responses stream out.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Protocol

import torch

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine, RequestOutput
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import PromptEmbeds

logger = logging.getLogger(__name__)

CANCEL_POLL_INTERVAL_S = 0.05


class ResponseSink(Protocol):
    """Where one request's outputs go (a Triton response sender in production, a list in tests)."""

    def send(self, output: RequestOutput) -> None: ...

    def fail(self, message: str) -> None: ...

    def is_cancelled(self) -> bool: ...


def engine_config_from_parameters(parameters: dict[str, str]) -> EngineConfig:
    """Build an EngineConfig from a Triton config's string `parameters` (see model_repository/llm).

    device "auto" picks cuda when available. Raises ValueError for malformed values.
    """
    p = dict(parameters)
    device = p.pop("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    ints = ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
            "num_kv_blocks")
    values: dict = {"model_path": p.pop("model_path"), "device": device}
    for key in ints:
        if p.get(key) not in (None, ""):
            values[key] = int(p.pop(key))
        else:
            p.pop(key, None)
    for key in ("dtype", "attention_backend"):
        if p.get(key):
            values[key] = p.pop(key)
    if p.get("gpu_memory_utilization"):
        values["gpu_memory_utilization"] = float(p.pop("gpu_memory_utilization"))
    if p.get("enforce_eager"):
        values["enforce_eager"] = p.pop("enforce_eager").lower() in ("1", "true", "yes")
    return EngineConfig(**values)


class LLMService:
    """Runs an engine in the background for many concurrent requests.

    Args:
        engine: the engine; only the loop thread touches it after `start`.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, ResponseSink] = {}
        self._sinks_lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._engine_loop, name="llm-engine-loop", daemon=True),
                         threading.Thread(target=self._response_loop, name="llm-responses", daemon=True)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    @property
    def num_active(self) -> int:
        with self._sinks_lock:
            return len(self._sinks)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               sink: ResponseSink, prompt_embeds: PromptEmbeds | None = None) -> None:
        """Accept a request; outputs go to `sink` from the response thread.

        `prompt_embeds` (encoder outputs for placeholder positions) replaces those tokens' embeddings.

        Raises:
            ValueError: the request can never be served (length limits); nothing was queued.
        """
        self.engine.validate_request(len(prompt_token_ids), params)
        if prompt_embeds is not None:
            prompt_embeds.check(len(prompt_token_ids))
        with self._sinks_lock:
            if request_id in self._sinks:
                raise ValueError(f"duplicate request id {request_id}")
            self._sinks[request_id] = sink
        self._inbox.put(("add", request_id, (prompt_token_ids, prompt_embeds), params))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Cancel a request; its KV blocks are freed at the start of the next loop iteration."""
        self._inbox.put(("abort", request_id, None, None))
        self._wakeup.set()

    def _engine_loop(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            self._drain_inbox()
            if not engine.has_unfinished():
                self._wakeup.wait(timeout=0.1)
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except Exception:  # a fault in one step must not take the stage down
                logger.exception("engine step failed; failing the requests in flight")
                for request_id in list(engine.requests):
                    engine.abort(request_id)
                    self._outbox.put((request_id, "engine step failed (see server log)"))
                continue
            for output in outputs:
                self._outbox.put((output.request_id, output))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, request_id, prompt, params = self._inbox.get_nowait()  # prompt: (ids, embeds) for "add"
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add_request(request_id, prompt[0], params, prompt_embeds=prompt[1])
                except (ValueError, OverflowError) as exc:
                    self._outbox.put((request_id, str(exc)))
            else:
                output = self.engine.abort(request_id)
                if output is not None:
                    self._outbox.put((request_id, output))

    def _response_loop(self) -> None:
        next_poll = time.monotonic()
        while not self._stopping.is_set():
            try:
                request_id, item = self._outbox.get(timeout=CANCEL_POLL_INTERVAL_S)
            except queue.Empty:
                item = None
            if item is not None:
                self._deliver(request_id, item)
            if time.monotonic() >= next_poll:
                self._poll_cancellations()
                next_poll = time.monotonic() + CANCEL_POLL_INTERVAL_S

    def _deliver(self, request_id: str, item: RequestOutput | str) -> None:
        with self._sinks_lock:
            sink = self._sinks.get(request_id)
            finished = isinstance(item, str) or item.finished
            if finished:
                self._sinks.pop(request_id, None)
        if sink is None:
            return
        try:
            if isinstance(item, str):
                sink.fail(item)
            else:
                sink.send(item)
        except Exception:  # the client went away; stop generating for it
            logger.exception("sending a response for %s failed; aborting it", request_id)
            if not finished:
                self.abort(request_id)

    def _poll_cancellations(self) -> None:
        """Abort cancelled requests. Triton closes a cancelled stream itself (it sends the final flag once
        `is_cancelled` has returned True), so the sink is dropped and nothing more is sent on it."""
        with self._sinks_lock:
            sinks = list(self._sinks.items())
        for request_id, sink in sinks:
            if sink.is_cancelled():
                with self._sinks_lock:
                    self._sinks.pop(request_id, None)
                self.abort(request_id)

    def shutdown(self) -> None:
        """Stop both threads; requests still in flight get an error."""
        self._stopping.set()
        self._wakeup.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=5)
        with self._sinks_lock:
            sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            try:
                sink.fail("server is shutting down")
            except Exception:
                logger.exception("failing a request at shutdown")
