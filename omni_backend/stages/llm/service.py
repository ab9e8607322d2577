"""LLMService: an engine loop, a response thread, a stop watch and a metrics thread around one LLMEngine.

The client side of the llm stage (vLLM v1's `core_client.py`): `submit` checks and admits a request in the
caller's thread, hands it to the engine loop (`core.EngineCore`) as a typed message, and registers its sink with the
response thread (`outputs.OutputRouter`). A second engine instance (a talker) or a distributed worker builds the
same service around its own engine.

Admission: the power/temperature governor (omni_backend/ops/governor.py) may refuse new requests while its GPU is at
its critical temperature (`NotAdmitting`, Triton UNAVAILABLE); and the service holds at most `max_num_seqs +
max_queued_requests` requests (running plus waiting): past that `submit` refuses at once with `QueueFull` (Triton
UNAVAILABLE, error kind QUEUE_FULL: "waiting queue is full ... retry later"), so a burst never grows an unbounded
queue, and every request it accepted runs to the end. The refusal is synchronous (an error response straight from
`execute`, in milliseconds). The bound counts the requests held, not the scheduler's waiting list: that list fills
only when the engine loop drains its inbox, so read before then a burst would show none waiting, read after it
would show requests that could run at once as waiting. When the KV cache cannot hold `max_num_seqs` sequences, fewer
run and more of the held ones wait.

Errors reach a request's stream as `StageError`s (`omni_backend.vocabulary`): a step or loop that fails is INTERNAL,
a request the engine cannot take INVALID_ARGUMENT (or CONTEXT_LENGTH_EXCEEDED), the server shutting down
UNAVAILABLE.

Metric calls are IPC round trips too: the response thread only notes each finished request's timings, and a third
thread publishes them with a snapshot of the engine's gauges once per `metrics_interval_s` (ops/metrics.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Callable

from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import PromptEmbeds, PromptPositions
from omni_backend.engine.tp_ranks import COLLECTIVE_TIMEOUT
from omni_backend.ops.governor import Governor
from omni_backend.ops.metrics import LLMMetrics, LLMStats
from omni_backend.stages.llm.cancel_board import CancelBoard
from omni_backend.stages.llm.core import EngineCore
from omni_backend.stages.llm.loop import BackgroundLoop
from omni_backend.stages.llm.messages import AbortRequest, AddRequest, ResetPrefixCache
from omni_backend.stages.llm.outputs import OutputRouter, ResponseSink
from omni_backend.stages.llm.server_probe import check_operator_key
from omni_backend.stages.llm.stop_watch import StopWatch
from omni_backend.vocabulary import ErrorKind, StageError

if TYPE_CHECKING:  # imported by build.py only when the kv_events setting asks for it (pyzmq, msgpack)
    from omni_backend.ops.kv_event_stream import KVEventStream

logger = logging.getLogger(__name__)

LOOP_STUCK_AFTER_S = 20.0
QUEUE_FULL_RETRY_AFTER_S = 1
RESET_TIMEOUT_S = 60.0  # the longest an operator's reset waits for the engine loop (it comes between two steps)


class QueueFull(StageError):
    """A new request arrived while the service already holds `max_num_seqs + max_queued_requests` requests
    (kind QUEUE_FULL: Triton UNAVAILABLE; the OpenAI front door answers 429 with Retry-After). Nothing was queued."""

    def __init__(self, message: str):
        super().__init__(ErrorKind.QUEUE_FULL, message, retry_after_s=QUEUE_FULL_RETRY_AFTER_S)


class NotAdmitting(StageError):
    """A new request arrived while the governor refuses admission (error kind NOT_ADMITTING: Triton UNAVAILABLE,
    HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(ErrorKind.NOT_ADMITTING, message, retry_after_s=retry_after_s)


class LLMService:
    """Runs an engine in the background for many concurrent requests.

    Args:
        engine: the engine; only the loop thread touches its mutable state after `start`.
        governor: power/temperature governor of the engine's GPU (None: never limits).
        metrics: where the metrics thread publishes (None: no metrics thread).
        metrics_interval_s: seconds between publications.
        max_queued_requests: requests held beyond the engine's `max_num_seqs` (they wait to run); `submit`
            refuses more with QueueFull. 0: no limit.
        stopping: probe, True once the server is shutting down or unloading the model (None: never asked).
        stop_grace_s: seconds requests may run on after `stopping` first says True (`stop_watch.StopWatch`).
            None: never aborted.
        operator_key: the key `reset_prefix_cache_as_operator` requires (`server_probe.parent_operator_key`);
            None: nobody may reset through it.
        cancel_board: where cancels by key that found no request wait (`cancel_board.CancelBoard`; default: this
            process only).
        kv_events: the stream the engine loop hands the prefix cache's KV events to (ops/kv_event_stream.py),
            closed by `shutdown`; None: no events are recorded.

    Attributes:
        core: the engine loop; router: the response thread; stop_watch: the stop watch, or None.

    Raises:
        ValueError: max_queued_requests < 0.
    """

    def __init__(self, engine: LLMEngine, governor: Governor | None = None, metrics: LLMMetrics | None = None,
                 metrics_interval_s: float = 1.0, max_queued_requests: int = 0,
                 stopping: Callable[[], bool] | None = None, stop_grace_s: float | None = None,
                 operator_key: str | None = None, cancel_board: CancelBoard | None = None,
                 kv_events: KVEventStream | None = None):
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        self.core = EngineCore(engine, governor, kv_events)
        self.router = OutputRouter(self.core.outbox, self.abort, note_finished=metrics is not None,
                                   board=cancel_board)
        self.stop_watch = StopWatch(stopping, stop_grace_s, self.router.held, self.abort) \
            if stopping is not None and stop_grace_s is not None else None
        self.metrics = metrics
        self.metrics_interval_s = metrics_interval_s
        self.max_queued_requests = max_queued_requests
        # requests held at once (running + waiting), None: no limit
        self.capacity = engine.config.max_num_seqs + max_queued_requests if max_queued_requests else None
        self.num_rejected = 0  # requests refused with QueueFull since start
        self.operator_key = operator_key
        self._metrics_loop = _MetricsLoop(self, metrics_interval_s) if metrics is not None else None

    @property
    def engine(self) -> LLMEngine:
        return self.core.engine

    @property
    def governor(self) -> Governor | None:
        return self.core.governor

    @property
    def num_active(self) -> int:
        """Requests held: submitted and their streams not ended."""
        return self.router.num_held

    def start(self) -> None:
        for part in (self.core, self.router, self.stop_watch, self._metrics_loop):
            if part is not None:
                part.start()

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               sink: ResponseSink, prompt_embeds: PromptEmbeds | None = None,
               prompt_positions: PromptPositions | None = None) -> None:
        """Accept a request; outputs go to `sink` from the response thread.

        `prompt_embeds` (encoder outputs for placeholder positions) replaces those tokens' embeddings;
        `prompt_positions` are the prompt's M-RoPE ids (a model that reads them).

        Raises:
            ValueError: the request can never be served (`LLMEngine.make_sequence`); nothing was queued.
            NotAdmitting: the governor refuses new requests (critical GPU temperature); nothing was queued.
            QueueFull: `capacity` requests are already held (running or waiting); nothing was queued.
        """
        submitted = time.monotonic()
        seq = self.engine.make_sequence(request_id, prompt_token_ids, params, prompt_embeds, prompt_positions)
        refusal = self.governor.refusal() if self.governor is not None else None
        if refusal is not None:
            raise NotAdmitting(refusal, self.governor.config.retry_after_s)
        with self.router.lock:
            if self.router.holds_locked(request_id):
                raise ValueError(f"duplicate request id {request_id}")
            held = self.router.num_held_locked()
            if self.capacity is not None and held >= self.capacity:
                self.num_rejected += 1
                raise QueueFull(f"waiting queue is full: the llm stage holds {held} requests (max_num_seqs "
                                f"{self.engine.config.max_num_seqs} running + max_queued_requests "
                                f"{self.max_queued_requests} waiting); retry later")
            self.router.add_locked(request_id, sink, submitted)
            # under the lock: an abort for this id (cancel poll, stop watch) can only be queued after the add
            self.core.put(AddRequest(seq))

    def cancel(self, request_id: str) -> None:
        """End request `request_id` as if its client had cancelled it (aborted, its stream ended with the final
        flag alone), soon, on the response thread (the only one that sends on admitted requests); nothing happens
        for a request that already ended or was never submitted."""
        self.router.cancel(request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its KV blocks are freed at the start of the next loop iteration."""
        self.core.put(AbortRequest(request_id))

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        """Forget every cached prefix (for benchmarks that must start cold), done by the engine loop before its
        next step. Returns a future of the number of cached blocks dropped."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.core.put(ResetPrefixCache(done))
        return done

    def reset_prefix_cache_as_operator(self, given_key: object, timeout_s: float = RESET_TIMEOUT_S) -> int:
        """An operator's `reset_prefix_cache` request: `reset_prefix_cache`, waited for (the engine loop does it
        between two steps).

        Args:
            given_key: the key the request carries (its `omni-admin-key` parameter: a string), None without one.
            timeout_s: the longest wait for the engine loop (seconds).

        Returns:
            the number of cached KV blocks dropped.

        Raises:
            StageError: INVALID_ARGUMENT (field `omni-admin-key`) when `given_key` is not `operator_key` or there is
                none (`server_probe.check_operator_key`); UNAVAILABLE when the engine loop did not get to it within
                `timeout_s` (it is done later).
        """
        check_operator_key(given_key, self.operator_key)
        try:
            return self.reset_prefix_cache().result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise StageError(ErrorKind.UNAVAILABLE, f"the engine loop did not reset the prefix cache within "
                             f"{timeout_s:.0f} s (it will when it gets to it)") from None

    def stats(self) -> LLMStats:
        """A snapshot for the metrics, read from another thread than the loop's (plain attribute reads).

        Takes the finished requests and the grammar compile times noted since the previous call.
        """
        engine = self.engine
        runner, scheduler = engine.runner, engine.scheduler
        blocks = runner.block_manager
        graphs = runner.graph_runner
        governor = self.governor
        reading = governor.reading if governor is not None and governor.enabled else None
        return LLMStats(
            running=len(scheduler.running), waiting=len(scheduler.waiting),
            kv_blocks_used=blocks.num_blocks - blocks.num_free_blocks, kv_blocks_total=blocks.num_blocks,
            preemptions=scheduler.num_preemptions, oom_recoveries=engine.num_oom_recoveries,
            kv_events_dropped=self.core.kv_events.num_dropped_events if self.core.kv_events is not None else 0,
            graph_replays=graphs.num_replays if graphs else 0,
            graph_padded_rows=graphs.num_padded_rows if graphs else 0,
            eager_steps=runner.num_eager_steps, step_sequences=runner.num_step_sequences,
            prefix_cache_enabled=blocks.enable_prefix_caching, prefix_cache_queries=blocks.prefix_cache_queries,
            prefix_cache_hits=blocks.prefix_cache_hits, prefix_cache_blocks=blocks.num_cached_blocks,
            structured_requests=engine.grammars.num_requests, grammar_cache_hits=engine.grammars.num_cache_hits,
            grammar_compile_s=engine.grammars.take_compile_seconds(),
            governor_state=int(governor.state) if governor is not None else 0,
            num_seqs_limit=scheduler.num_seqs_limit,
            power_w=reading.power_w if reading else 0.0, temperature_c=reading.temperature_c if reading else 0.0,
            sm_clock_mhz=reading.sm_clock_mhz if reading else 0.0,
            finished=self.router.take_finished(),
        )

    def heartbeat_time(self) -> float:
        """Unix time (s) for the stage's heartbeat: now while both the engine loop and the response thread keep
        iterating, else when the stuck one last began an iteration (so the heartbeat goes stale at once).

        A loop counts as stuck after LOOP_STUCK_AFTER_S without a new iteration: well above the longest step
        (a 1024-token CPU prefill takes seconds on a loaded 2-core machine), so a slow step is not a hang.
        An engine out of service (`EngineCore.refusal`) stops the heartbeat at once.
        """
        progress = {"engine loop": self.core.last_iteration, "response thread": self.router.last_iteration}
        stuck = min(progress, key=progress.get)
        stalled = time.monotonic() - progress[stuck]
        now = time.time()
        if self.core.refusal is not None:
            logger.error("the llm engine is out of service; its heartbeat stops: %s", self.core.refusal)
            return now - (time.monotonic() - self.core.last_iteration)
        if stalled < LOOP_STUCK_AFTER_S:
            return now
        logger.error("the llm stage's %s has not iterated for %.0f s; its heartbeat stops", stuck, stalled)
        return now - stalled

    def shutdown(self) -> None:
        """Stop the threads; requests still in flight get an error.

        An engine loop still inside a step after `BackgroundLoop.stop`'s wait, with tensor-parallel ranks, may be
        in a collective: the ranks are killed first (the collective fails), and the process group is destroyed
        (`LLMEngine.close`) only once the loop has left it; a loop still there after COLLECTIVE_TIMEOUT is left
        to the process's exit, the group with it.
        """
        for part in (self.core, self.router, self.stop_watch, self._metrics_loop):
            if part is not None:
                part.stop()
        ranks = self.core.engine.runner.ranks
        if ranks is not None and self.core.alive:
            logger.warning("the llm engine loop is still in a step; killing its tensor-parallel ranks")
            ranks.terminate()
            self.core.join(COLLECTIVE_TIMEOUT.total_seconds())
        if ranks is not None and self.core.alive:
            logger.error("the llm engine loop did not leave its step; its process group is left to the exit")
        else:
            self.core.engine.close()  # its other tensor-parallel ranks, if any: the loop has ended
        self.router.fail_all(StageError(ErrorKind.UNAVAILABLE, "server is shutting down"))
        self.router.board.close()
        if self.core.kv_events is not None:
            self.core.kv_events.close()


class _MetricsLoop(BackgroundLoop):
    """Publishes the service's stats and heartbeat every `interval_s` (each publication is IPC to the server)."""

    def __init__(self, service: LLMService, interval_s: float):
        super().__init__("llm-metrics", interval_s)
        self.service = service

    def iterate(self) -> None:
        self.service.metrics.publish(self.service.stats(), now=self.service.heartbeat_time())
