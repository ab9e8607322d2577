"""The `llm` stage: an LLMEngine driven by one engine-loop thread, with responses sent from another thread.

Triton's Python backend calls `execute` on one thread; `sender.send` and `is_cancelled` are IPC round trips to
the server. Keeping them off the engine loop (as Triton's vLLM backend does with its response thread) lets the
loop go straight from one step to the next while responses stream out. Metric calls are IPC too: the response
thread only notes each finished request's timings, and a third thread publishes them with a snapshot of the
engine's gauges once per `metrics_interval_s` (see omni_backend/ops/metrics.py).

The power/temperature governor (omni_backend/ops/governor.py) is consulted once per loop iteration: it sets the
scheduler's sequences-per-step limit, and while the GPU is at its critical temperature `submit` refuses new
requests with `NotAdmitting` (Triton UNAVAILABLE) while admitted ones run to the end.

Overload: the service holds at most `max_num_seqs + max_queued_requests` requests (running plus waiting); past
that `submit` refuses at once with `QueueFull` (Triton UNAVAILABLE, error kind QUEUE_FULL: "waiting queue is full
... retry later"), so a burst never grows an unbounded queue, and every request it accepted runs to the end.

Errors reach a request's stream as `StageError`s (`omni_backend.vocabulary`): their kind travels in the message's
header, because Triton 2.51 hands a decoupled model's clients only the message. A step or loop that fails is
INTERNAL, a request the engine cannot take INVALID_ARGUMENT, the server shutting down UNAVAILABLE.

Prefix cache reset (for benchmarks that must start cold): a request whose `reset_prefix_cache` input is true, with
the operator's key (the one tritonserver's restricted-API flags hold) in its request parameter `omni-admin-key`,
makes the engine loop forget every cached prefix before its next step; its one response carries `dropped_blocks`.
`input_ids` and `sampling_params` are optional in the model's config only for that request and for a cancel request
(`generation_inputs` refuses a generation request without them).

Cancellation by key: a generation sent with a `stream_key` is ended by a later request whose `cancel` input is that
key, exactly as if its own client had cancelled it (aborted, KV blocks freed, its stream ended with the final flag
alone). The streaming entry points (omni_backend/stages/entry_points.py) use it because python_backend 24.10 cannot
cancel the requests a Python model sends (BLS).

Shutdown: tritonserver keeps the model loaded while requests it accepted still stream, but when its
`--exit-timeout-secs` runs out with a decoupled request in flight, 2.51 crashes in its teardown (signal 11/6 seen)
and hangs without answering those clients. So while requests are held a watch thread asks every 0.5 s whether the
server is stopping (its HTTP endpoint, which closes as shutdown begins: see `parent_server_probe`); from then on
requests get `stop_grace_s` (the exit timeout less STOP_MARGIN_S) to finish, and those still held are aborted
(finish reason "abort"), so the server exits cleanly and every client gets an ending.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hmac
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Protocol

import numpy as np

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine, RequestOutput
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import PromptEmbeds
from omni_backend.launch.tritonserver import ADMIN_KEY_HEADER, admin_key_of
from omni_backend.ops.governor import Governor, GovernorConfig
from omni_backend.ops.gpu_budget import apply_gpu_memory_budget
from omni_backend.ops.hardware import cpu_engine_threads, resolve_device, runtime_versions
from omni_backend.ops.metrics import FinishedRequest, LLMMetrics, LLMStats
from omni_backend.stages.tensors import one_value
from omni_backend.vocabulary import ErrorKind, FieldError, StageError

logger = logging.getLogger(__name__)

CANCEL_POLL_INTERVAL_S = 0.05
STOP_POLL_INTERVAL_S = 0.5  # how often the watch thread asks whether the server is stopping
STOP_MARGIN_S = 3.0  # aborting, the last responses and unloading must fit between the abort and the exit timeout
# `is_cancelled` is an IPC round trip per request: with many streams on a busy CPU a round of polls can take
# tens of ms, so rounds are spaced at least this many times their own duration (polling <= 1/5 of the thread).
CANCEL_POLL_SPACING = 4
LOOP_STUCK_AFTER_S = 20.0
QUEUE_FULL_RETRY_AFTER_S = 1
RESET_TIMEOUT_S = 60.0  # the longest an operator's reset waits for the engine loop (it comes between two steps)
INPUT_NAMES = ("input_ids", "sampling_params", "reset_prefix_cache", "stream_key", "cancel")  # read as arrays


class QueueFull(StageError):
    """A new request arrived while the service already holds `max_num_seqs + max_queued_requests` requests
    (kind QUEUE_FULL: Triton UNAVAILABLE; the OpenAI front door answers 429 with Retry-After). Nothing was queued."""

    def __init__(self, message: str):
        super().__init__(ErrorKind.QUEUE_FULL, message, retry_after_s=QUEUE_FULL_RETRY_AFTER_S)


class ResponseSink(Protocol):
    """Where one request's outputs go (a Triton response sender in production, a list in tests)."""

    def send(self, output: RequestOutput) -> None: ...

    def fail(self, error: StageError) -> None: ...

    def close(self) -> None:
        """End the stream without a response (the final flag alone), after a cancellation."""

    def is_cancelled(self) -> bool: ...


def max_queued_requests_from_parameters(parameters: dict[str, str]) -> int:
    """The `max_queued_requests` parameter: requests held beyond max_num_seqs (0, empty or absent: no limit).

    Raises:
        ValueError: not an integer >= 0.
    """
    text = (parameters.get("max_queued_requests") or "").strip()
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"max_queued_requests must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise ValueError(f"max_queued_requests must be an integer >= 0, got {value}")
    return value


def is_reset_request(arrays: dict) -> bool:
    """Whether the llm model's input arrays (input name -> numpy array, `INPUT_NAMES` that are present) are an
    operator's prefix cache reset: `reset_prefix_cache` BOOL [1] true.

    Raises:
        FieldError: `reset_prefix_cache` true together with a generation input (a reset is a request of its own).
    """
    if not one_value(arrays, "reset_prefix_cache", bool, False):
        return False
    given = [name for name in ("input_ids", "sampling_params") if name in arrays]
    if given:
        raise FieldError("reset_prefix_cache", f"is a request of its own: send it without {' and '.join(given)}")
    return True


def cancel_key(arrays: dict) -> str | None:
    """The key of a cancel request (`cancel` STRING [1]: the `stream_key` of the generation to end), None for any
    other request.

    Raises:
        FieldError: `cancel` together with a generation input (a cancel is a request of its own), or not one UTF-8
            string.
    """
    key = one_value(arrays, "cancel", str)
    if key is None:
        return None
    given = [name for name in ("input_ids", "sampling_params", "stream_key") if name in arrays]
    if given:
        raise FieldError("cancel", f"is a request of its own: send it without {' and '.join(given)}")
    return key


def generation_inputs(arrays: dict) -> tuple[list[int], SamplingParams]:
    """A generation request's prompt token ids and sampling parameters from the llm model's input arrays
    (`input_ids` INT32 [n], `sampling_params` STRING [1], the JSON of a SamplingParams).

    Both are optional in the model's config only so that a reset request (`is_reset_request`) can go without them.

    Raises:
        FieldError: `input_ids` or `sampling_params` missing, or `sampling_params` not one UTF-8 string.
        ValueError: `sampling_params` that SamplingParams.from_json refuses.
    """
    for name in ("input_ids", "sampling_params"):
        if name not in arrays:
            raise FieldError(name, "is required (a generation request takes input_ids and sampling_params)")
    ids = np.asarray(arrays["input_ids"]).reshape(-1).tolist()
    return ids, SamplingParams.from_json(one_value(arrays, "sampling_params", str))


def tritonserver_flags(cmdline: list[str]) -> dict[str, str]:
    """`--name=value` and `--name value` flags of a tritonserver command line, by name without dashes."""
    flags, i = {}, 1
    while i < len(cmdline):
        arg = cmdline[i]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if not eq and i + 1 < len(cmdline) and not cmdline[i + 1].startswith("--"):
                value, i = cmdline[i + 1], i + 1
            flags[name] = value
        i += 1
    return flags


def parent_tritonserver_flags(pid: int | None = None) -> dict[str, str] | None:
    """The flags (`tritonserver_flags`) of the tritonserver that started this stub process (its parent, or `pid`);
    None when that process is not a tritonserver or its command line cannot be read."""
    try:
        with open(f"/proc/{pid or os.getppid()}/cmdline", "rb") as file:
            cmdline = [part.decode(errors="replace") for part in file.read().split(b"\0") if part]
    except OSError:
        return None
    if not cmdline or not os.path.basename(cmdline[0]).startswith("tritonserver"):
        return None
    return tritonserver_flags(cmdline)


def parent_operator_key(pid: int | None = None) -> str | None:
    """The operator's key of the tritonserver that started this stub process (its parent, or `pid`): the one its
    restricted-API flags require in the `omni-admin-key` header (launch.tritonserver.admin_key_of). None when
    the parent is not a tritonserver or restricts nothing with that header (then nobody may reset the cache)."""
    flags = parent_tritonserver_flags(pid)
    return admin_key_of(flags) if flags is not None else None


def parent_server_probe(pid: int | None = None) -> tuple[Callable[[], bool] | None, int | None]:
    """(probe, exit timeout in s) for the tritonserver that started this stub process (its parent, or `pid`).

    Read from its command line: the exit timeout (`--exit-timeout-secs`, default 30) and its HTTP endpoint. The
    probe answers True once `GET /v2/health/live` there fails: tritonserver 2.51 closes its HTTP endpoint as soon
    as shutdown begins (seen: connection refused 0.5 s after SIGTERM). A Python model has no other way to learn
    it: `pb_utils.is_model_ready` raises once shutdown began, but a second call from a thread hung the stub here.
    (None, None) when the parent is not a tritonserver with HTTP on (the watch is then off).
    """
    flags = parent_tritonserver_flags(pid)
    if flags is None:
        return None, None
    if flags.get("allow-http", "true").lower() in ("false", "0", "no"):
        return None, None
    try:
        port, exit_timeout_s = int(flags.get("http-port", "8000")), int(flags.get("exit-timeout-secs", "30"))
    except ValueError:
        return None, None
    host = flags.get("http-address", "127.0.0.1")
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/v2/health/live"

    def stopping() -> bool:
        """True when the port refuses the connection (or answers not live); a timeout or other error raises
        (an unknown answer: a busy server must not look like a stopping one)."""
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                return response.status != 200
        except urllib.error.HTTPError:
            return True
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ConnectionRefusedError):
                return True
            raise
        except ConnectionRefusedError:
            return True

    return stopping, exit_timeout_s


def instance_device(requested: str, instance_kind: str | None = None, instance_device_id: str | int | None = None,
                    resolve: Callable[[str], str] = resolve_device) -> str:
    """The device of this model instance's engine.

    Triton tells a Python model its instance's kind and device (`args["model_instance_kind"]`,
    `args["model_instance_device_id"]`). A KIND_GPU instance group runs one instance per listed GPU (data
    parallel inside one tritonserver, see repository.llm_instance_group), and each instance's engine takes its
    own GPU. Otherwise the `device` parameter decides ("auto", "cpu", "cuda", "cuda:N"), through `resolve`
    (ops.hardware.resolve_device, which warns when NVML sees a GPU that torch cannot use and fails loudly for an
    explicit CUDA device torch cannot use).

    Raises:
        ValueError: the device parameter contradicts a KIND_GPU instance; what `resolve` raises.
    """
    if instance_kind != "GPU":
        return resolve(requested)
    device = f"cuda:{int(instance_device_id or 0)}"
    if requested == "cpu" or (requested.startswith("cuda:") and requested != device):
        raise ValueError(f"device {requested!r} contradicts this KIND_GPU instance on {device}")
    return resolve(device)


def engine_config_from_parameters(parameters: dict[str, str], device: str) -> EngineConfig:
    """Build an EngineConfig from a Triton config's string `parameters` (see model_repository/llm) for the engine
    on `device` (`instance_device`). kv_cache_bytes "0" or empty: the device's default.

    Raises:
        ValueError: malformed values.
    """
    p = dict(parameters)
    p.pop("device", None)
    ints = ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
            "num_kv_blocks", "cpu_threads")
    values: dict = {"model_path": p.pop("model_path"), "device": device}
    for key in ints:
        if p.get(key) not in (None, ""):
            values[key] = int(p.pop(key))
        else:
            p.pop(key, None)
    if values.get("kv_cache_bytes") == 0:
        del values["kv_cache_bytes"]
    for key in ("dtype", "attention_backend", "quantization"):
        if p.get(key):
            values[key] = p.pop(key)
    if p.get("gpu_memory_utilization"):
        values["gpu_memory_utilization"] = float(p.pop("gpu_memory_utilization"))
    for key in ("enforce_eager", "enable_prefix_caching"):
        if p.get(key):
            values[key] = p.pop(key).lower() in ("1", "true", "yes")
    return EngineConfig(**values)


class LLMService:
    """Runs an engine in the background for many concurrent requests.

    Args:
        engine: the engine; only the loop thread touches it after `start`.
        governor: power/temperature governor of the engine's GPU (None: never limits).
        metrics: where the metrics thread publishes (None: no metrics thread).
        metrics_interval_s: seconds between publications.
        max_queued_requests: requests held beyond the engine's `max_num_seqs` (they wait to run); `submit`
            refuses more with QueueFull. 0: no limit.
        stopping: probe, True once the server is shutting down or unloading the model (None: never asked).
        stop_grace_s: seconds requests may run on after `stopping` first says True (after it has said False at
            least once); then the ones still held are aborted. None: never aborted.
        operator_key: the key `reset_prefix_cache_as_operator` requires (`parent_operator_key`); None: nobody
            may reset through it.

    Raises:
        ValueError: max_queued_requests < 0.
    """

    def __init__(self, engine: LLMEngine, governor: Governor | None = None, metrics: LLMMetrics | None = None,
                 metrics_interval_s: float = 1.0, max_queued_requests: int = 0,
                 stopping: Callable[[], bool] | None = None, stop_grace_s: float | None = None,
                 operator_key: str | None = None):
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        self.engine = engine
        self.governor = governor
        self.metrics = metrics
        self.metrics_interval_s = metrics_interval_s
        self.max_queued_requests = max_queued_requests
        # requests held at once (running + waiting), None: no limit
        self.capacity = engine.config.max_num_seqs + max_queued_requests if max_queued_requests else None
        self.num_rejected = 0  # requests refused with QueueFull since start
        self.stopping, self.stop_grace_s = stopping, stop_grace_s
        self.operator_key = operator_key
        self._seen_ready = False  # `stopping` said False once (a probe that never works never aborts anything)
        self._probe_failed = False  # the traceback of a failing probe is logged once
        self.stop_deadline: float | None = None  # time.monotonic() when held requests are aborted
        self._aborted_for_stop: set[str] = set()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._cancels: queue.SimpleQueue = queue.SimpleQueue()  # request ids `cancel` was asked for
        self._sinks: dict[str, ResponseSink] = {}
        self._submitted: dict[str, float] = {}  # request id -> time.monotonic() at submit; under _sinks_lock
        self._sinks_lock = threading.Lock()
        self._finished: collections.deque[FinishedRequest] = collections.deque()  # for the metrics thread
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        # time.monotonic() when each loop last began an iteration (see heartbeat_time)
        self._progress = {"engine loop": time.monotonic(), "response thread": time.monotonic()}
        self._threads = [threading.Thread(target=self._engine_loop, name="llm-engine-loop", daemon=True),
                         threading.Thread(target=self._response_loop, name="llm-responses", daemon=True)]
        if metrics is not None:
            self._threads.append(threading.Thread(target=self._metrics_loop, name="llm-metrics", daemon=True))
        if stopping is not None and stop_grace_s is not None:
            self._threads.append(threading.Thread(target=self._stop_watch_loop, name="llm-stop-watch", daemon=True))

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
            NotAdmitting: the governor refuses new requests (critical GPU temperature); nothing was queued.
            QueueFull: `capacity` requests are already held (running or waiting); nothing was queued.
        """
        submitted = time.monotonic()
        self.engine.validate_request(prompt_token_ids, params)
        if prompt_embeds is not None:
            prompt_embeds.check(len(prompt_token_ids))
        if self.governor is not None:
            self.governor.check_admission()
        with self._sinks_lock:
            if request_id in self._sinks:
                raise ValueError(f"duplicate request id {request_id}")
            if self.capacity is not None and len(self._sinks) >= self.capacity:
                self.num_rejected += 1
                raise QueueFull(f"waiting queue is full: the llm stage holds {len(self._sinks)} requests "
                                f"(max_num_seqs {self.engine.config.max_num_seqs} running + max_queued_requests "
                                f"{self.max_queued_requests} waiting); retry later")
            self._sinks[request_id] = sink
            self._submitted[request_id] = submitted
            # under the lock: an abort for this id (cancel poll, stop watch) can only be queued after the add
            self._inbox.put(("add", request_id, (prompt_token_ids, prompt_embeds), params))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Cancel a request; its KV blocks are freed at the start of the next loop iteration."""
        self._inbox.put(("abort", request_id, None, None))
        self._wakeup.set()

    def cancel(self, request_id: str) -> None:
        """End request `request_id` as if its client had cancelled it (`_end_stream`: aborted, final flag alone),
        soon, on the response thread (the only one that sends on admitted requests); nothing happens for a request
        that already ended or was never submitted."""
        self._cancels.put(request_id)

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        """Forget every cached prefix (for benchmarks that must start cold), done by the engine loop before its
        next step. Returns a future of the number of cached blocks dropped."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("reset", None, None, done))
        self._wakeup.set()
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
                none; UNAVAILABLE when the engine loop did not get to it within `timeout_s` (it is done later).
        """
        if not self.operator_key:
            raise StageError(ErrorKind.INVALID_ARGUMENT, f"{ADMIN_KEY_HEADER} cannot open a prefix cache reset: "
                             "this tritonserver has no operator key (no restricted-API flag for that header)",
                             ADMIN_KEY_HEADER)
        if not isinstance(given_key, str) or not hmac.compare_digest(given_key.encode(), self.operator_key.encode()):
            raise StageError(ErrorKind.INVALID_ARGUMENT, f"{ADMIN_KEY_HEADER} (a request parameter) must be the "
                             "operator's key to reset the prefix cache", ADMIN_KEY_HEADER)
        try:
            return self.reset_prefix_cache().result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise StageError(ErrorKind.UNAVAILABLE, f"the engine loop did not reset the prefix cache within "
                             f"{timeout_s:.0f} s (it will when it gets to it)") from None

    def _engine_loop(self) -> None:
        self.engine.runner.device.bind_thread()  # kernels launch on the current device (engine/device.py)
        while not self._stopping.is_set():
            self._progress["engine loop"] = time.monotonic()
            try:
                self.run_once()
            except Exception:  # the loop must outlive any fault, or every request in flight would hang
                logger.exception("engine loop iteration failed; failing the requests in flight")
                self._fail_all(StageError(ErrorKind.INTERNAL, "engine loop failed (see server log)"))

    def _fail_all(self, error: StageError) -> None:
        for request_id in list(self.engine.requests):
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("aborting %s failed", request_id)
            self._outbox.put((request_id, error))

    def run_once(self) -> None:
        """One engine-loop iteration: governor, inbox, one engine step (or a wait of up to 0.1 s when idle).

        The loop thread calls it; tests call it directly on a service that was not started.
        """
        engine = self.engine
        if self.governor is not None and self.governor.enabled:
            limit = self.governor.tick(time.monotonic())
            if limit != engine.scheduler.num_seqs_limit:
                engine.scheduler.set_num_seqs_limit(limit)
        self._drain_inbox()
        if not engine.has_unfinished():
            self._wakeup.wait(timeout=0.1)
            self._wakeup.clear()
            return
        try:
            outputs = engine.step()
        except Exception:  # a fault in one step must not take the stage down
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all(StageError(ErrorKind.INTERNAL, "engine step failed (see server log)"))
            return
        for output in outputs:
            self._outbox.put((output.request_id, output))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, request_id, prompt, params = self._inbox.get_nowait()  # prompt: (ids, embeds) for "add"
            except queue.Empty:
                return
            if kind == "reset":
                params.set_result(self.engine.runner.block_manager.reset_prefix_cache())  # params: the future
            elif kind == "add":
                try:
                    self.engine.add_request(request_id, prompt[0], params, prompt_embeds=prompt[1])
                except ValueError as exc:
                    self._outbox.put((request_id, StageError.of(exc, "llm")))
                except OverflowError as exc:  # the scheduler's own waiting bound (unused by the stage)
                    self._outbox.put((request_id, StageError(ErrorKind.QUEUE_FULL, str(exc))))
            else:
                output = self.engine.abort(request_id)
                if output is not None:
                    self._outbox.put((request_id, output))

    def _response_loop(self) -> None:
        next_poll = time.monotonic()
        while not self._stopping.is_set():
            self._progress["response thread"] = time.monotonic()
            try:
                for request_id, item in self._take_outbox():
                    try:  # one failing delivery must not drop the others taken with it
                        self._deliver(request_id, item)
                    except Exception:
                        logger.exception("delivering a response for %s failed", request_id)
                self._take_cancels()
                if time.monotonic() >= next_poll:
                    began = time.monotonic()
                    self._poll_cancellations()
                    took = time.monotonic() - began
                    next_poll = began + took + max(CANCEL_POLL_INTERVAL_S, CANCEL_POLL_SPACING * took)
            except Exception:  # keep serving the other requests
                logger.exception("response thread iteration failed")

    def _stop_watch_loop(self) -> None:
        while not self._stopping.wait(STOP_POLL_INTERVAL_S):
            try:
                self.watch_for_stop()
            except Exception:  # the watch must never take the stage down
                logger.exception("the stop watch failed")

    def watch_for_stop(self) -> None:
        """One look of the watch thread: while requests are held (and, until the server has once said it is not
        stopping, also while idle), ask `stopping`; `stop_grace_s` after it first says the server is stopping
        (having said it is not, once), abort every request still held (each ends with finish reason "abort").
        Its own thread: a slow probe never holds up responses."""
        now = time.monotonic()
        if not self.num_active and self._seen_ready:
            return
        if self.stop_deadline is None or now < self.stop_deadline:  # during the grace too: a false alarm clears
            try:
                stopping = self.stopping()
            except Exception:  # an unknown answer: ask again later, change nothing
                logger.warning("asking whether the server is stopping failed", exc_info=not self._probe_failed)
                self._probe_failed = True
                return
            if not stopping:
                if self.stop_deadline is not None:
                    logger.warning("the server answers again: not stopping after all")
                self._seen_ready, self.stop_deadline = True, None
                return
            if not self._seen_ready:
                return
            if self.stop_deadline is None:
                self.stop_deadline = now + self.stop_grace_s
                logger.warning("the server is stopping with %d requests in flight; those still running in %.1f s "
                               "are aborted so that it exits within its exit timeout", self.num_active,
                               self.stop_grace_s)
            if now < self.stop_deadline:
                return
        with self._sinks_lock:
            held = [request_id for request_id in self._sinks if request_id not in self._aborted_for_stop]
        for request_id in held:
            self._aborted_for_stop.add(request_id)
            self.abort(request_id)
        if held:
            logger.warning("aborted %d requests still running at the server's exit timeout", len(held))

    def _take_outbox(self) -> list[tuple[str, RequestOutput | StageError]]:
        """Everything in the outbox (waiting up to the cancellation poll interval for the first item), with
        each request's consecutive unfinished outputs joined into one delta. A response costs an IPC round
        trip whatever its size, so when sending falls behind the engine (many streams, busy CPU) clients
        get the same text in fewer, larger chunks instead of a growing backlog."""
        try:
            items = [self._outbox.get(timeout=CANCEL_POLL_INTERVAL_S)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._outbox.get_nowait())
            except queue.Empty:
                break
        joined: list[tuple[str, RequestOutput | StageError]] = []
        open_output: dict[str, int] = {}  # request id -> index in `joined` of its unfinished output
        for request_id, item in items:
            index = open_output.pop(request_id, None)
            if index is not None and isinstance(item, RequestOutput):
                joined[index] = (request_id, joined[index][1].followed_by(item))
            else:
                index = len(joined)
                joined.append((request_id, item))
            if isinstance(joined[index][1], RequestOutput) and not joined[index][1].finished:
                open_output[request_id] = index
        return joined

    def _deliver(self, request_id: str, item: RequestOutput | StageError) -> None:
        submitted = None
        failed = isinstance(item, StageError)
        with self._sinks_lock:
            sink = self._sinks.get(request_id)
            finished = failed or item.finished
            if finished:
                self._sinks.pop(request_id, None)
                submitted = self._submitted.pop(request_id, None)
        if sink is not None:
            try:
                if failed:
                    sink.fail(item)
                else:
                    sink.send(item)
            except Exception:  # the client went away: stop generating for it and end its stream as a cancel
                logger.exception("sending a response for %s failed; aborting it", request_id)
                if not finished:
                    self._end_stream(request_id, sink)
        if submitted is not None and not failed and self.metrics is not None:
            self._finished.append(_finished_request(item, submitted, time.monotonic()))

    def _poll_cancellations(self) -> None:
        """Abort cancelled requests and end their streams with the final flag (`sink.close`).

        python_backend's contract is that a decoupled model still sends the final flag for a cancelled request;
        without it Triton 2.51 never releases the request's gRPC state (measured: tritonserver grew ~31 KiB per
        cancelled llm stream, without end). The sink is dropped before the flag is sent, and this thread is the
        only one sending on admitted requests, so nothing is sent after it: the request's outputs still queued
        find no sink in `_deliver`."""
        with self._sinks_lock:
            sinks = list(self._sinks.items())
        for request_id, sink in sinks:
            if sink.is_cancelled():
                self._end_stream(request_id, sink)

    def _take_cancels(self) -> None:
        """End the requests `cancel` was asked for since the last look."""
        while True:
            try:
                request_id = self._cancels.get_nowait()
            except queue.Empty:
                return
            with self._sinks_lock:
                sink = self._sinks.get(request_id)
            if sink is not None:
                self._end_stream(request_id, sink)

    def _end_stream(self, request_id: str, sink: ResponseSink) -> None:
        """Drop the request's sink, abort it and send its final flag alone (`sink.close`); nothing is sent after."""
        with self._sinks_lock:
            self._sinks.pop(request_id, None)
            self._submitted.pop(request_id, None)
        self.abort(request_id)
        try:
            sink.close()
        except Exception:  # the stream is gone either way
            logger.exception("ending the request %s failed", request_id)

    def stats(self) -> LLMStats:
        """A snapshot for the metrics, read from another thread than the loop's (plain attribute reads).

        Takes the finished requests noted since the previous call.
        """
        engine = self.engine
        runner, scheduler = engine.runner, engine.scheduler
        blocks = runner.block_manager
        graphs = runner.graph_runner
        governor = self.governor
        reading = governor.reading if governor is not None and governor.enabled else None
        finished = []
        while self._finished:
            finished.append(self._finished.popleft())
        return LLMStats(
            running=len(scheduler.running), waiting=len(scheduler.waiting),
            kv_blocks_used=blocks.num_blocks - blocks.num_free_blocks, kv_blocks_total=blocks.num_blocks,
            preemptions=scheduler.num_preemptions, oom_recoveries=engine.num_oom_recoveries,
            graph_replays=graphs.num_replays if graphs else 0,
            graph_padded_rows=graphs.num_padded_rows if graphs else 0,
            eager_steps=runner.num_eager_steps,
            prefix_cache_enabled=blocks.enable_prefix_caching, prefix_cache_queries=blocks.prefix_cache_queries,
            prefix_cache_hits=blocks.prefix_cache_hits, prefix_cache_blocks=blocks.num_cached_blocks,
            governor_state=int(governor.state) if governor is not None else 0,
            num_seqs_limit=scheduler.num_seqs_limit,
            power_w=reading.power_w if reading else 0.0, temperature_c=reading.temperature_c if reading else 0.0,
            sm_clock_mhz=reading.sm_clock_mhz if reading else 0.0,
            finished=finished,
        )

    def heartbeat_time(self) -> float:
        """Unix time (s) for the stage's heartbeat: now while both the engine loop and the response thread keep
        iterating, else when the stuck one last began an iteration (so the heartbeat goes stale at once).

        A loop counts as stuck after LOOP_STUCK_AFTER_S without a new iteration: well above the longest step
        (a 1024-token CPU prefill takes seconds on a loaded 2-core machine), so a slow step is not a hang.
        """
        stalled = time.monotonic() - min(self._progress.values())
        now = time.time()
        if stalled < LOOP_STUCK_AFTER_S:
            return now
        stuck = min(self._progress, key=self._progress.get)
        logger.error("the llm stage's %s has not iterated for %.0f s; its heartbeat stops", stuck, stalled)
        return now - stalled

    def _metrics_loop(self) -> None:
        while not self._stopping.wait(self.metrics_interval_s):
            try:
                self.metrics.publish(self.stats(), now=self.heartbeat_time())
            except Exception:  # metrics must never take the stage down
                logger.exception("publishing metrics failed")

    def shutdown(self) -> None:
        """Stop the threads; requests still in flight get an error."""
        self._stopping.set()
        self._wakeup.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=5)
        with self._sinks_lock:
            sinks, self._sinks = self._sinks, {}
            self._submitted.clear()
        for sink in sinks.values():
            try:
                sink.fail(StageError(ErrorKind.UNAVAILABLE, "server is shutting down"))
            except Exception:
                logger.exception("failing a request at shutdown")


def _finished_request(output: RequestOutput, submitted: float, now: float) -> FinishedRequest:
    """Timings of a finished request, measured from its arrival at this stage (`submit`)."""
    return FinishedRequest(
        prompt_tokens=output.prompt_tokens, completion_tokens=output.completion_tokens, e2e_s=now - submitted,
        ttft_s=output.first_token_time - submitted if output.first_token_time is not None else None,
        queue_s=output.first_scheduled_time - submitted if output.first_scheduled_time is not None else None,
    )


def build_engine_on_a_passing_thread(config: EngineConfig) -> LLMEngine:
    """`LLMEngine(config)`, built on a thread that exits once it is done, so that afterwards only the engine-loop
    thread runs torch's parallel CPU regions.

    Why: torch's CPU kernels parallelise with OpenMP (libgomp), which keeps a pool of worker threads for every
    thread that ever entered a parallel region, until that thread exits. Loading the weights on the stub's main
    thread would leave its pool beside the engine loop's; with more pool threads than cores libgomp stops
    spinning between regions ("throttled" spin, GOMP_SPINCOUNT in the libgomp manual), so every parallel op
    then pays a futex wake-up. Measured on this project's 2-core CPU machine: a parallel elementwise op
    33 -> 210 us, and the llm stage at 217 instead of 386 output tok/s for bench_engine's workload.

    Raises:
        what LLMEngine raises (re-raised here).
    """
    built: list = []

    def build() -> None:
        try:
            built.append(LLMEngine(config))
        except BaseException as exc:  # handed to the caller's thread
            built.append(exc)

    thread = threading.Thread(target=build, name="llm-engine-build")
    thread.start()
    thread.join()
    if isinstance(built[0], BaseException):
        raise built[0]
    return built[0]


def create_service(parameters: dict[str, str], pb_utils=None, model: str = "llm", version: str = "1",
                   metrics_interval_s: float = 1.0, instance_kind: str | None = None,
                   instance_device_id: str | int | None = None) -> LLMService:
    """Engine, governor and (with `pb_utils`) metrics from a Triton config's string parameters, for the model
    instance Triton describes (`instance_device`); not started. On a GPU the process is first capped at
    `gpu_memory_utilization` of the device (ops/gpu_budget.py), the share the engine sizes its KV cache in. A CPU
    engine gets `cpu_threads` torch threads, 0 meaning the usable cores minus one (`ops.hardware.cpu_engine_threads`).
    With `pb_utils` (in a stub process) the operator's key for prefix cache resets is the parent tritonserver's
    (`parent_operator_key`).

    Raises:
        ValueError: malformed parameters; RuntimeError: a CUDA device torch cannot use; what LLMEngine raises.
    """
    device = instance_device(parameters.get("device") or "auto", instance_kind, instance_device_id)
    config = engine_config_from_parameters(parameters, device)
    if config.torch_device.type == "cpu":  # a server process: leave a core to tritonserver and the front door
        config.cpu_threads = cpu_engine_threads(config.cpu_threads)
    apply_gpu_memory_budget(device, config.gpu_memory_utilization, model)
    max_queued_requests = max_queued_requests_from_parameters(parameters)
    governor_config = GovernorConfig.from_parameters(parameters)
    engine = build_engine_on_a_passing_thread(config)
    governor = Governor.for_device(config.torch_device, config.max_num_seqs, governor_config)
    metrics = None
    if pb_utils is not None:
        runner = engine.runner
        versions = runtime_versions()
        info = {key: versions[key] for key in ("torch", "cuda_runtime", "cuda_driver", "triton")}
        info.update(attention_backend=runner.attention_backend, matmuls=runner.matmuls,
                    fallback_reason=runner.fallback_reason)
        metrics = LLMMetrics(pb_utils, model, version, runner.attention_backend, str(runner.device.torch_device),
                             info)
    probe, exit_timeout_s = parent_server_probe() if pb_utils is not None else (None, None)
    stop_grace_s = max(0.0, exit_timeout_s - STOP_MARGIN_S) if exit_timeout_s is not None else None
    operator_key = parent_operator_key() if pb_utils is not None else None
    return LLMService(engine, governor, metrics, metrics_interval_s, max_queued_requests, probe, stop_grace_s,
                      operator_key)
