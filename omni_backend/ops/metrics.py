"""Prometheus metrics of the llm stage through Triton's custom metrics (`pb_utils.MetricFamily`).

Every metric call is an IPC round trip from the stub to the server, so none happens on the engine loop: the
loop and the response thread only append plain records, and `LLMService`'s metrics thread calls
`LLMMetrics.publish` about once a second with an `LLMStats` snapshot. Families (labels `model`, `version`, and
`device`, the engine's device: a KIND_GPU instance group runs one llm instance per GPU in one server):

    omni_time_to_first_token_seconds    histogram  llm arrival -> first token sampled
    omni_inter_token_latency_seconds    histogram  per request: (e2e - TTFT) / (completion tokens - 1)
    omni_e2e_request_latency_seconds    histogram  llm arrival -> final response sent
    omni_queue_time_seconds             histogram  llm arrival -> first scheduled (the llm stage's queue;
                                                   Triton's nv_inference_queue_duration_us covers the
                                                   other stages)
    omni_prompt_tokens_total            counter    prompt tokens of finished requests
    omni_generation_tokens_total        counter    completion tokens of finished requests (the clients'
                                                   completion_tokens; aborted requests included)
    omni_requests_running / _waiting    gauge      engine's running list / waiting queue
    omni_kv_cache_blocks_used / _total  gauge      paged KV cache blocks
    omni_preemptions_total              counter    recompute preemptions
    omni_prefix_cache_queries_total     counter    prompt tokens looked up in the prefix cache at admission (a
                                                   preempted request's again at its re-admission)
    omni_prefix_cache_hits_total        counter    of those, tokens whose KV blocks were reused (hit rate: hits /
                                                   queries, vLLM's prefix_cache_queries/_hits)
    omni_prefix_cache_blocks            gauge      KV blocks holding a reusable prefix (in use or evictable)
    omni_prefix_cache_enabled           gauge      1 when prefix caching is on, 0 when the enable_prefix_caching
                                                   setting turned it off
    omni_structured_requests_total      counter    requests constrained to a grammar (structured outputs)
    omni_grammar_cache_hits_total       counter    of those, grammars found compiled or compiling (one compile per
                                                   distinct schema/regex/grammar: engine/structured_output.py)
    omni_grammar_compile_seconds        histogram  time to compile one grammar (s), off the engine loop
    omni_oom_recoveries_total           counter    steps that ran out of device memory and were retried with
                                                   half the token budget (engine/scheduler.py)
    omni_kv_events_dropped_total        counter    KV events not published because the stream's buffer was full
                                                   (ops/kv_event_stream.py; 0 while the kv_events setting is off)
    omni_engine_steps_total{mode}       counter    steps run as a CUDA-graph replay (mode="cuda_graph") or eagerly
    omni_cuda_graph_padded_rows_total   counter    padding rows replayed (batch rounded up to a bucket)
    omni_engine_step_sequences_total    counter    sequences in those steps, summed: over omni_engine_steps_total
                                                   (both modes) the mean batch size, above 1 only when some step
                                                   ran more than one sequence (one counter, not a histogram of
                                                   batch sizes: an observation per step would be an IPC call each)
    omni_attention_backend{backend}     gauge      1 for the attention backend in use
    omni_runtime_info{torch,cuda_runtime,cuda_driver,triton,attention_backend,attention_reason,matmuls,
                      matmul_kernel,fallback_reason,dtype,dtype_reason}
                                        gauge      1; the versions the engine runs with (cuda_driver: the CUDA
                                                   version the driver supports, from NVML), its attention backend
                                                   and why the selector chose it (engine/attention/selector.py),
                                                   what runs its matmuls (ModelRunner.matmuls: cpu-kernels-float32,
                                                   cpu-kernels-int8, cpu-kernels-bfloat16, onednn-packed, torch)
                                                   and its microkernel (ModelRunner.matmul_kernel, e.g. fma,
                                                   avx512_vnni, avx512_fma, amx; "" without the C++ step) and
                                                   why its attention backend or matmuls are not the first choice
                                                   ("" when they are), its dtype and why (configured, by device,
                                                   or measured on this CPU: engine/cpu_dtype.py)
    omni_governor_state                 gauge      0 disabled (no NVML), 1 normal, 2 power-limited, 3 not admitting
    omni_governor_max_num_seqs          gauge      sequences-per-step limit the governor allows
    omni_gpu_power_watts, omni_gpu_temperature_celsius, omni_gpu_sm_clock_mhz
                                        gauge      last NVML reading (0 while the governor is disabled)
    omni_stage_heartbeat_timestamp_seconds
                                        gauge      Unix time of the stage's last publication: the stage's
                                                   liveness (see `stale_stages`); every other Python-backend
                                                   stage publishes it too (`StageHeartbeat`)

ITL is one observation per request (the mean gap between its tokens, genai-perf's definition) rather than
one per token, which would cost an IPC call per token.

The same snapshots also feed the load metrics under vLLM's names (`vllm:num_requests_waiting`, ...), labelled
`model_name` and `engine` as vLLM's: ops/standard_metrics.py.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from omni_backend.ops.standard_metrics import StandardMetrics

logger = logging.getLogger(__name__)

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0]
ITL_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0]
QUEUE_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0]
COMPILE_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


@dataclass
class FinishedRequest:
    """Timings (s) and token counts of one finished request; None where it never got that far."""

    prompt_tokens: int
    completion_tokens: int
    e2e_s: float
    ttft_s: float | None
    queue_s: float | None

    @property
    def mean_itl_s(self) -> float | None:
        """Mean time between its tokens (s), genai-perf's ITL: (e2e - TTFT) / (completion tokens - 1); None for
        fewer than two tokens or no first token."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass
class LLMStats:
    """A snapshot of the llm stage; counters are cumulative since start."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    preemptions: int = 0
    oom_recoveries: int = 0
    kv_events_dropped: int = 0
    graph_replays: int = 0
    graph_padded_rows: int = 0
    eager_steps: int = 0
    step_sequences: int = 0
    prefix_cache_enabled: bool = False
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_blocks: int = 0
    structured_requests: int = 0
    grammar_cache_hits: int = 0
    grammar_compile_s: list[float] = field(default_factory=list)
    governor_state: int = 0
    num_seqs_limit: int = 0
    power_w: float = 0.0
    temperature_c: float = 0.0
    sm_clock_mhz: float = 0.0
    finished: list[FinishedRequest] = field(default_factory=list)


class LLMMetrics:
    """Creates the families once and publishes snapshots.

    Args:
        pb_utils: `triton_python_backend_utils` (or a stand-in with its MetricFamily API).
        model, version: label values (Triton's own metrics use the same label names).
        attention_backend: name for the `omni_attention_backend` gauge.
        device: the engine's device, the `device` label ("cpu", "cuda:0", ...).
        runtime_info: label values of `omni_runtime_info` (ops.hardware.runtime_versions plus attention_backend,
            attention_reason, matmuls, matmul_kernel, fallback_reason, dtype and dtype_reason); None: the gauge is
            not published.
        engine_index: the engine's index among the server's llm engines (llm/parameters.place_instance), the `engine`
            label of the vLLM-named metrics (ops/standard_metrics.py).
    """

    def __init__(self, pb_utils, model: str, version: str, attention_backend: str, device: str = "cpu",
                 runtime_info: dict[str, str] | None = None, engine_index: int = 0):
        family = pb_utils.MetricFamily
        labels = {"model": model, "version": str(version), "device": device}
        self._families = []  # a MetricFamily must outlive its metrics

        def metric(name, description, kind, buckets=None, **extra):
            fam = family(name=name, description=description, kind=kind)
            self._families.append(fam)
            if buckets is None:
                return fam.Metric(labels={**labels, **extra})
            return fam.Metric(labels={**labels, **extra}, buckets=buckets)

        H, C, G = family.HISTOGRAM, family.COUNTER, family.GAUGE
        self.ttft = metric("omni_time_to_first_token_seconds", "Time to first token (s)", H, TTFT_BUCKETS)
        self.itl = metric("omni_inter_token_latency_seconds", "Mean time between tokens per request (s)", H,
                          ITL_BUCKETS)
        self.e2e = metric("omni_e2e_request_latency_seconds", "Request latency, arrival to last response (s)", H,
                          E2E_BUCKETS)
        self.queue = metric("omni_queue_time_seconds", "Time a request waited before its first step (s)", H,
                            QUEUE_BUCKETS)
        self.prompt_tokens = metric("omni_prompt_tokens_total", "Prompt tokens of finished requests", C)
        self.generation_tokens = metric("omni_generation_tokens_total",
                                        "Generated tokens of finished requests (aborted ones included)", C)
        self.running = metric("omni_requests_running", "Requests in the running batch", G)
        self.waiting = metric("omni_requests_waiting", "Requests waiting to be scheduled", G)
        self.kv_used = metric("omni_kv_cache_blocks_used", "KV cache blocks in use", G)
        self.kv_total = metric("omni_kv_cache_blocks_total", "KV cache blocks", G)
        self.preemptions = metric("omni_preemptions_total", "Sequences preempted (recompute)", C)
        self.prefix_queries = metric("omni_prefix_cache_queries_total",
                                     "Prompt tokens looked up in the prefix cache at admission", C)
        self.prefix_hits = metric("omni_prefix_cache_hits_total",
                                  "Prompt tokens whose KV blocks the prefix cache supplied", C)
        self.prefix_blocks = metric("omni_prefix_cache_blocks", "KV blocks holding a reusable prefix", G)
        self.prefix_enabled = metric("omni_prefix_cache_enabled", "1 when prefix caching is on", G)
        self.structured = metric("omni_structured_requests_total", "Requests constrained to a grammar", C)
        self.grammar_hits = metric("omni_grammar_cache_hits_total",
                                   "Constrained requests whose grammar was compiled or compiling already", C)
        self.grammar_compile = metric("omni_grammar_compile_seconds", "Time to compile one grammar (s)", H,
                                      COMPILE_BUCKETS)
        self.oom_recoveries = metric("omni_oom_recoveries_total",
                                     "Steps out of device memory, retried with half the token budget", C)
        steps = pb_utils.MetricFamily(name="omni_engine_steps_total", kind=C,
                                      description="Engine steps by how the model ran (CUDA-graph replay or eager)")
        self._families.append(steps)
        self.graph_steps = steps.Metric(labels={**labels, "mode": "cuda_graph"})
        self.eager_steps = steps.Metric(labels={**labels, "mode": "eager"})
        self.padded_rows = metric("omni_cuda_graph_padded_rows_total", "Padding rows in CUDA-graph replays", C)
        self.step_sequences = metric("omni_engine_step_sequences_total",
                                     "Sequences in the engine's steps, summed (over omni_engine_steps_total: the mean "
                                     "batch size)", C)
        self.backend = metric("omni_attention_backend", "1 for the attention backend in use", G,
                              backend=attention_backend)
        self.backend.set(1)
        if runtime_info is not None:
            self.runtime_info = metric("omni_runtime_info", "1; versions the llm engine runs with, what runs its "
                                       "matmuls, and why its attention backend or matmuls fell back", G,
                                       **runtime_info)
            self.runtime_info.set(1)
        self.governor_state = metric("omni_governor_state",
                                     "0 disabled (no NVML), 1 normal, 2 power-limited, 3 not admitting", G)
        self.num_seqs_limit = metric("omni_governor_max_num_seqs", "Sequences per step the governor allows", G)
        self.power = metric("omni_gpu_power_watts", "GPU power draw (W)", G)
        self.temperature = metric("omni_gpu_temperature_celsius", "GPU temperature (C)", G)
        self.sm_clock = metric("omni_gpu_sm_clock_mhz", "GPU SM clock (MHz)", G)
        self.heartbeat = metric(HEARTBEAT, HEARTBEAT_DESCRIPTION, G)
        self.kv_events_dropped = metric("omni_kv_events_dropped_total",
                                        "KV events not published: the KV-event stream's buffer was full", C)
        self.standard = StandardMetrics(pb_utils, model, str(engine_index))
        self._last = LLMStats()

    def publish(self, stats: LLMStats, now: float | None = None) -> None:
        """Set the heartbeat to `now` (Unix seconds, default time.time()), observe the finished requests, add
        counter deltas, set gauges (IPC calls: not on the engine loop)."""
        self.heartbeat.set(time.time() if now is None else now)
        prompt = generated = 0
        for request in stats.finished:
            prompt += request.prompt_tokens
            generated += request.completion_tokens
            self.e2e.observe(request.e2e_s)
            if request.queue_s is not None:
                self.queue.observe(request.queue_s)
            if request.ttft_s is not None:
                self.ttft.observe(request.ttft_s)
            if request.mean_itl_s is not None:
                self.itl.observe(request.mean_itl_s)
            self.standard.observe(request)
        for seconds in stats.grammar_compile_s:
            self.grammar_compile.observe(seconds)
        last = self._last
        for metric, delta in ((self.prompt_tokens, prompt), (self.generation_tokens, generated),
                              (self.structured, stats.structured_requests - last.structured_requests),
                              (self.grammar_hits, stats.grammar_cache_hits - last.grammar_cache_hits),
                              (self.preemptions, stats.preemptions - last.preemptions),
                              (self.prefix_queries, stats.prefix_cache_queries - last.prefix_cache_queries),
                              (self.prefix_hits, stats.prefix_cache_hits - last.prefix_cache_hits),
                              (self.oom_recoveries, stats.oom_recoveries - last.oom_recoveries),
                              (self.kv_events_dropped, stats.kv_events_dropped - last.kv_events_dropped),
                              (self.graph_steps, stats.graph_replays - last.graph_replays),
                              (self.eager_steps, stats.eager_steps - last.eager_steps),
                              (self.padded_rows, stats.graph_padded_rows - last.graph_padded_rows),
                              (self.step_sequences, stats.step_sequences - last.step_sequences)):
            if delta:
                metric.increment(delta)
        for (metric, value), (_, old) in zip(self._gauges(stats), self._gauges(last)):
            if value != old:  # gauges start at 0, as the first `last` does
                metric.set(value)
        stats.finished = []
        stats.grammar_compile_s = []
        self._last = stats

    def _gauges(self, stats: LLMStats) -> list[tuple[object, float]]:
        """Each gauge, the vLLM-named ones included, with its value in `stats`."""
        return [(self.running, stats.running), (self.waiting, stats.waiting), (self.kv_used, stats.kv_blocks_used),
                (self.kv_total, stats.kv_blocks_total), (self.prefix_blocks, stats.prefix_cache_blocks),
                (self.prefix_enabled, int(stats.prefix_cache_enabled)), (self.governor_state, stats.governor_state),
                (self.num_seqs_limit, stats.num_seqs_limit), (self.power, stats.power_w),
                (self.temperature, stats.temperature_c), (self.sm_clock, stats.sm_clock_mhz),
                *self.standard.gauges(stats)]


class EncoderMetrics:
    """The encoder cache's counters of a media encoder stage (omni_backend/stages/encoder_cache.py), labels `model`
    and `version`:

        omni_encoder_items_total        counter  images or clips the stage received
        omni_encoder_cache_hits_total   counter  of those, items that skipped the encoder (found in the cache, or
                                                 repeated within their batch)

    `publish` after each `execute` (two IPC calls at most, none when nothing changed).
    """

    def __init__(self, pb_utils, model: str, version: str):
        family = pb_utils.MetricFamily
        labels = {"model": model, "version": str(version)}
        self._families = [family(name="omni_encoder_items_total", kind=family.COUNTER,
                                 description="Images or clips an encoder stage received"),
                          family(name="omni_encoder_cache_hits_total", kind=family.COUNTER,
                                 description="Images or clips whose embeddings came from the encoder cache")]
        self.items, self.hits = (f.Metric(labels=labels) for f in self._families)
        self._last = (0, 0)

    def publish(self, num_items: int, num_encoded: int) -> None:
        """Add what changed since the last call, from the stage's cumulative counts."""
        items, hits = num_items, num_items - num_encoded
        if items != self._last[0]:
            self.items.increment(items - self._last[0])
        if hits != self._last[1]:
            self.hits.increment(hits - self._last[1])
        self._last = (items, hits)


BATCH_BUCKETS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]


@dataclass
class VoiceStats:
    """What the voice stage (omni_backend/stages/voice.py) did since its last snapshot: its talker engine's KV blocks
    and the answers it holds now; the batch size of each talker step and code2wav DiT call, and each answer's time to
    first audio (s), and the answers cancelled since then."""

    talker_kv_blocks_used: int = 0
    talker_kv_blocks_total: int = 0
    answers: int = 0
    talker_batches: list[int] = field(default_factory=list)
    code2wav_batches: list[int] = field(default_factory=list)
    first_audio_s: list[float] = field(default_factory=list)
    cancelled: int = 0


class VoiceMetrics:
    """The voice stage's metrics, labels `model` and `version`:

        omni_talker_kv_cache_blocks_used / _total  gauge      the talker engine's paged KV cache blocks
        omni_voice_answers                         gauge      answers the voice stage holds (talker or code2wav)
        omni_talker_batch_size                     histogram  answers that got a codec token in each talker step
        omni_code2wav_batch_size                   histogram  answers in each code2wav DiT call
        omni_voice_cancelled_total                 counter    answers ended by a cancel (their client went away)
        omni_voice_time_to_first_audio_seconds     histogram  an answer's first rows reaching the voice stage ->
                                                              its first chunk made (the thinker's time to its
                                                              first token comes before: omni_time_to_first_token)

    `publish` from the stage's worker thread, at most every few tenths of a second (IPC calls).
    """

    def __init__(self, pb_utils, model: str, version: str):
        family = pb_utils.MetricFamily
        labels = {"model": model, "version": str(version)}
        self._families = []  # a MetricFamily must outlive its metrics

        def metric(name, description, kind, buckets=None):
            fam = family(name=name, description=description, kind=kind)
            self._families.append(fam)
            return fam.Metric(labels=labels) if buckets is None else fam.Metric(labels=labels, buckets=buckets)

        G, H, C = family.GAUGE, family.HISTOGRAM, family.COUNTER
        self.kv_used = metric("omni_talker_kv_cache_blocks_used", "Talker KV cache blocks in use", G)
        self.kv_total = metric("omni_talker_kv_cache_blocks_total", "Talker KV cache blocks", G)
        self.answers = metric("omni_voice_answers", "Answers the voice stage holds", G)
        self.cancelled = metric("omni_voice_cancelled_total", "Answers ended by a cancel (their client went away)", C)
        self.talker_batch = metric("omni_talker_batch_size", "Answers that got a codec token in each talker step", H,
                                   BATCH_BUCKETS)
        self.batch = metric("omni_code2wav_batch_size", "Answers in each code2wav DiT call", H, BATCH_BUCKETS)
        self.first_audio = metric("omni_voice_time_to_first_audio_seconds",
                                  "An answer's first rows at the voice stage -> its first audio chunk made (s)", H,
                                  TTFT_BUCKETS)
        self._last = VoiceStats()

    def publish(self, stats: VoiceStats) -> None:
        """Observe the new batches and first audios; set the gauges that changed."""
        for size in stats.talker_batches:
            self.talker_batch.observe(size)
        for size in stats.code2wav_batches:
            self.batch.observe(size)
        for seconds in stats.first_audio_s:
            self.first_audio.observe(seconds)
        if stats.cancelled:
            self.cancelled.increment(stats.cancelled)
        last = self._last
        for metric, value, old in ((self.kv_used, stats.talker_kv_blocks_used, last.talker_kv_blocks_used),
                                   (self.kv_total, stats.talker_kv_blocks_total, last.talker_kv_blocks_total),
                                   (self.answers, stats.answers, last.answers)):
            if value != old:  # gauges start at 0, as the first `last` does
                metric.set(value)
        self._last = stats


class StageHeartbeat:
    """The heartbeat of a stage without an engine loop (every Python-backend model but llm): a daemon thread sets
    the `omni_stage_heartbeat_timestamp_seconds` gauge to the current Unix time every `interval_s` seconds for
    as long as the stub process lives, so a killed stub's heartbeat goes stale within STALE_AFTER_S and
    readiness (`stages_ready`, `python -m omni_backend.ops.ready`) turns false without waiting for a request to
    meet the dead stage. It shows that the process lives, not that its `execute` makes progress (the llm
    stage's heartbeat also stops when its loops hang; see omni_backend/stages/llm/service.py).

    Args:
        pb_utils: `triton_python_backend_utils` (or a stand-in with its MetricFamily API).
        model, version: label values, as Triton's `args["model_name"]` and `args["model_version"]`.
        interval_s: seconds between publications (each an IPC round trip to the server).
    """

    def __init__(self, pb_utils, model: str, version: str, interval_s: float = 1.0):
        family = pb_utils.MetricFamily
        self._family = family(name=HEARTBEAT, description=HEARTBEAT_DESCRIPTION, kind=family.GAUGE)
        self._gauge = self._family.Metric(labels={"model": model, "version": str(version)})
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"{model}-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        failing = False
        while True:
            try:
                self._gauge.set(time.time())
                failing = False
            except Exception:  # the heartbeat must never take the stage down; a missed beat shows as staleness
                if not failing:  # log when it starts failing, not every second
                    logger.exception("publishing the heartbeat failed")
                failing = True
            if self._stopping.wait(self._interval_s):
                return

    def stop(self) -> None:
        """End the thread (model finalize); the gauge keeps its last value."""
        self._stopping.set()
        self._thread.join(timeout=5)


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)', re.MULTILINE)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
NOT_ADMITTING = 3  # GovernorState.NOT_ADMITTING (not imported: that module pulls in torch)
HEARTBEAT = "omni_stage_heartbeat_timestamp_seconds"
HEARTBEAT_DESCRIPTION = "Unix time (s) at which the stage last showed progress"
"""One help text for every stage's family of that name; for the stages with a StageHeartbeat, "progress" means
only that the stub process lives."""
# A stage publishes about once a second; 3 s without a publication means its stub process died or hangs.
# (Triton 2.51 keeps a dead stub's model READY and never restarts a decoupled model's stub.)
STALE_AFTER_S = 3.0


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a Prometheus text page: name -> [(labels, value)] (histograms as name_bucket/_sum/_count)."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, labels, value in _SAMPLE.findall(text):
        samples.setdefault(name, []).append((dict(_LABEL.findall(labels)), float(value)))
    return samples


def governor_states(metrics_text: str) -> dict[tuple[str, str], int]:
    """(model, version) -> omni_governor_state, from a Prometheus text page; the highest state among a model's
    instances (one per GPU), so one instance that refuses new requests shows."""
    states: dict[tuple[str, str], int] = {}
    for labels, value in parse_metrics(metrics_text).get("omni_governor_state", []):
        key = (labels.get("model", ""), labels.get("version", ""))
        states[key] = max(states.get(key, 0), int(value))
    return states


def admitting(metrics_url: str, timeout_s: float = 2.0) -> tuple[bool, str]:
    """Readiness as the stages see it (`stages_ready` of the metrics page): (False, reason) when any stage
    refuses new requests or has stopped publishing.

    Triton 2.51 gives a Python model no way to flip the server's readiness, so a front door's /health (or a
    Kubernetes readiness probe wrapper) reads the governor gauge and the heartbeats from the metrics port.

    Raises:
        OSError: the metrics port did not answer.
    """
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
        return stages_ready(response.read().decode("utf-8", "replace"))


def stale_stages(metrics_text: str, now: float | None = None,
                 max_age_s: float = STALE_AFTER_S) -> dict[tuple[str, str], float]:
    """(model, version) -> seconds since its last heartbeat, for every stage whose heartbeat is older than
    `max_age_s` (`now`: Unix seconds, default time.time()). A stage that never published (gauge still 0) is not
    listed."""
    now = time.time() if now is None else now
    return {(labels.get("model", ""), labels.get("version", "")): now - value
            for labels, value in parse_metrics(metrics_text).get(HEARTBEAT, []) if value and now - value > max_age_s}


def stages_ready(metrics_text: str, now: float | None = None) -> tuple[bool, str]:
    """Readiness as the stages report it on Triton's metrics page: (False, reason) when a stage's governor
    refuses new requests or a stage's heartbeat is stale (its stub process died or hangs); else (True, "ok")."""
    dead = stale_stages(metrics_text, now)
    if dead:
        return False, "stage not responding (stub process dead or hung): " + ", ".join(
            f"{model}/{version} silent for {age:.1f} s" for (model, version), age in sorted(dead.items()))
    hot = [f"{model}/{version}" for (model, version), state in governor_states(metrics_text).items()
           if state == NOT_ADMITTING]
    if hot:
        return False, f"not admitting (critical GPU temperature): {', '.join(sorted(hot))}"
    return True, "ok"
