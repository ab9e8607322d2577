"""The voice stage: Qwen2.5-Omni's own speech (`omni_voice.OmniVoice`: talker engine + code2wav) behind one decoupled
Triton model, fed the thinker's rows by an entry point (stages/entry_points.py) as the llm stage streams them.

One answer is a series of requests under one `stream_key`, one per llm response, in order:

    first       also `voice`, `seed` and the thinker prompt's `prompt_tokens` (and its `prompt_positions`,
                `media_positions` for a prompt with media): the answer starts (an unknown voice is refused here)
    each        `hidden_states` and `input_embeds` FP32 [k, H] of that llm response (absent: no rows) and its
                `finish_reason` ("" while the thinker writes)
    cancel      `cancel` = the key alone: the answer ends in both engines (KV blocks freed), that request gets the
                final flag alone
    check       `voice` alone: answered with one response, `voice` = the model's voices as a JSON list, or with
                INVALID_ARGUMENT naming `voice` and the voices for a voice it lacks ("" asks for the list only;
                an entry point and the front door check the voice before the thinker runs)

A request whose `finish_reason` is "" is answered with the chunks made since the previous request of its answer,
then the final flag; the last one (finish_reason set) streams every chunk that follows, to the answer's final chunk
(finish_reason "stop"). A chunk is `waveform` FP32 [n] (samples in [-1, 1] at `sample_rate`), `chunk_index` and
`finish_reason`. A talker or code2wav failure ends that answer alone with an INTERNAL error.

`VoiceWorker` owns the OmniVoice on one thread: `execute` only parses a request and queues it; the worker applies
what is queued between its steps, so a request never waits for a step to finish. It also publishes the stage's
metrics (ops/metrics.py `VoiceMetrics`: talker KV blocks, answers held, batch sizes, time to first audio)
at most every PUBLISH_INTERVAL_S while busy, and once more before it waits idle.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from omni_backend import tensor_names as T
from omni_backend.engine.models import registry
from omni_backend.ops.metrics import VoiceStats
from omni_backend.settings import parse_field
from omni_backend.stages.code2wav import Chunk, Code2WavSettings
from omni_backend.stages.talker import SPEAKER_FILE, TalkerSettings
from omni_backend.stages.tensors import one_value, string_tensor
from omni_backend.vocabulary import ErrorKind, FieldError, StageError

logger = logging.getLogger(__name__)

INPUT_NAMES = (T.STREAM_KEY, T.CANCEL, T.VOICE, T.SEED, T.PROMPT_TOKENS, T.PROMPT_POSITIONS, T.MEDIA_POSITIONS,
               T.HIDDEN_STATES, T.INPUT_EMBEDS, T.FINISH_REASON)
OUTPUT_NAMES = (T.WAVEFORM, T.SAMPLE_RATE, T.CHUNK_INDEX, T.FINISH_REASON)
FINAL_REASON = "stop"  # the finish_reason of an answer's last chunk
PUBLISH_INTERVAL_S = 0.5


class ChunkSink(Protocol):
    """Where a request's responses go (a `triton_glue.StreamSender` in production)."""

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None: ...

    def fail(self, error: BaseException) -> None: ...

    def close(self) -> None: ...


class Voice(Protocol):
    """What the worker drives: `omni_voice.OmniVoice`."""

    def start(self, request_id: str, voice: str, seed: int, num_prompt_tokens: int,
              prompt_positions: torch.Tensor | None = None, media_positions: torch.Tensor | None = None) -> None: ...

    def push(self, request_id: str, hidden: torch.Tensor | None, embeds: torch.Tensor | None,
             finished: bool) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[Chunk]: ...

    def abort(self, request_id: str) -> None: ...

    def kv_blocks(self) -> tuple[int, int]: ...

    talker_batch_sizes: Counter  # talker steps per batch size
    code2wav: Any  # its `batch_sizes` Counter: DiT calls per batch size


@dataclass
class VoiceRequest:
    """One voice request, parsed (module docstring): `kind` is "push", "cancel" or "check"."""

    kind: str
    key: str = ""
    voice: str | None = None
    seed: int | None = None
    prompt_tokens: int | None = None
    prompt_positions: torch.Tensor | None = None
    media_positions: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    finished: bool = False


def parse_request(arrays: dict) -> VoiceRequest:
    """A voice request from its input arrays (`INPUT_NAMES`).

    Raises:
        FieldError: no `stream_key`, `cancel` or `voice`; `hidden_states` without `input_embeds` (or the reverse)
            or of a shape other than [k, H]; a shape [1] tensor holding more values.
    """
    cancel = one_value(arrays, T.CANCEL, str)
    if cancel is not None:
        return VoiceRequest("cancel", cancel)
    key = one_value(arrays, T.STREAM_KEY, str)
    voice = one_value(arrays, T.VOICE, str)
    if key is None:
        if voice is None:
            raise FieldError(T.STREAM_KEY, "is required (or cancel, or voice alone to check a voice)")
        return VoiceRequest("check", voice=voice)
    hidden, embeds = arrays.get(T.HIDDEN_STATES), arrays.get(T.INPUT_EMBEDS)
    if (hidden is None) != (embeds is None):
        raise FieldError(T.INPUT_EMBEDS if embeds is None else T.HIDDEN_STATES,
                         f"is required with {T.HIDDEN_STATES if embeds is None else T.INPUT_EMBEDS}")
    if hidden is not None:
        for name, array in ((T.HIDDEN_STATES, hidden), (T.INPUT_EMBEDS, embeds)):
            if np.ndim(array) != 2:
                raise FieldError(name, f"must be [rows, width], got shape {list(np.shape(array))}")
        hidden, embeds = (torch.from_numpy(np.array(a, dtype=np.float32)) for a in (hidden, embeds))
    positions, media = arrays.get(T.PROMPT_POSITIONS), arrays.get(T.MEDIA_POSITIONS)
    return VoiceRequest(
        "push", key, voice, one_value(arrays, T.SEED, int), one_value(arrays, T.PROMPT_TOKENS, int),
        None if positions is None or not np.size(positions) else torch.from_numpy(np.asarray(positions, np.int64)),
        None if media is None or not np.size(media) else torch.from_numpy(np.asarray(media, np.int64).reshape(-1)),
        hidden, embeds, bool(one_value(arrays, T.FINISH_REASON, str, "")))


def chunk_arrays(chunk: Chunk, sample_rate: int) -> dict[str, np.ndarray]:
    """One chunk's response arrays (module docstring)."""
    return {T.WAVEFORM: chunk.audio.detach().to(torch.float32).cpu().numpy().reshape(-1),
            T.SAMPLE_RATE: np.array([sample_rate], np.int32), T.CHUNK_INDEX: np.array([chunk.index], np.int32),
            T.FINISH_REASON: string_tensor(FINAL_REASON if chunk.final else "")}


@dataclass
class _Answer:
    """An answer's chunks not yet sent, the request of its that streams the rest (its last), and whether its final
    chunk has gone (a talker that stopped before its thinker did: later requests get the final flag alone)."""

    pending: list[Chunk] = field(default_factory=list)
    listener: ChunkSink | None = None
    ended: bool = False


class VoiceWorker:
    """Drives a `Voice` on its own thread and answers the voice requests (module docstring).

    Args:
        voice: the OmniVoice (or a stand-in in tests).
        voices: the voice names it speaks (for `check` requests; unknown ones are refused naming these).
        sample_rate: the waveform's samples per second.
        start: start the thread now (tests may queue requests first).
        publish: where the metrics snapshots go (`VoiceMetrics.publish`), None: nowhere.
    """

    def __init__(self, voice: Voice, voices: tuple[str, ...], sample_rate: int, start: bool = True,
                 publish: Callable[[VoiceStats], None] | None = None):
        self.voice, self.voices, self.sample_rate = voice, voices, sample_rate
        self.answers: dict[str, _Answer] = {}
        self.publish = publish
        self._started: dict[str, float] = {}  # answers without a chunk yet: when their first request was applied
        self._first_audio: list[float] = []
        self._cancelled = 0
        self._batches = (Counter(), Counter())  # the talker's and code2wav's batch sizes at the last snapshot
        self._published_at = 0.0
        self._dirty = False
        self._inbox: queue.SimpleQueue[tuple[VoiceRequest, ChunkSink] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="voice-worker", daemon=True)
        if start:
            self._thread.start()

    def submit(self, arrays: dict, sink: ChunkSink) -> None:
        """A request's input arrays; its responses go to `sink` (a refused request is answered at once)."""
        try:
            request = parse_request(arrays)
            if request.voice and request.kind in ("check", "push"):
                self.check_voice(request.voice)
        except Exception as exc:  # bad input: this request only
            sink.fail(exc)
            return
        if request.kind == "check":
            sink.send({T.VOICE: string_tensor(json.dumps(list(self.voices)))}, final=True)
            return
        self._inbox.put((request, sink))

    def check_voice(self, voice: str) -> None:
        """Raises: StageError INVALID_ARGUMENT naming `voice` and the voices, for a voice this model lacks."""
        if voice not in self.voices:
            raise StageError(ErrorKind.INVALID_ARGUMENT, f"voice {voice!r} is not a voice of this model; its voices: "
                             f"{', '.join(self.voices)}", T.VOICE)

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def run_once(self, block: bool) -> bool:
        """Apply the queued requests (waiting for one when `block` and there is nothing to step), then one step
        when there is work; False once shut down. The worker thread's loop body (tests call it directly)."""
        while True:
            idle = not self.voice.has_work()
            if block and idle and self._inbox.empty():
                self._snapshot(force=True)
            try:
                item = self._inbox.get(block=block and idle)
            except queue.Empty:
                break
            if item is None:
                return False
            self._apply(*item)
            self._dirty, block = True, False
        if self.voice.has_work():
            for chunk in self.voice.step():
                started = self._started.pop(chunk.request_id, None)
                if started is not None:
                    self._first_audio.append(time.monotonic() - started)
                self._deliver(chunk)
            self._dirty = True
        self._snapshot(force=False)
        return True

    def _snapshot(self, force: bool) -> None:
        """Publish the metrics when something changed and PUBLISH_INTERVAL_S passed (or `force`)."""
        now = time.monotonic()
        if self.publish is None or not self._dirty or (not force and now - self._published_at < PUBLISH_INTERVAL_S):
            return
        now_sizes = (self.voice.talker_batch_sizes, self.voice.code2wav.batch_sizes)
        talker, code2wav = ([size for size, count in (new - old).items() for _ in range(count)]
                            for new, old in zip(now_sizes, self._batches))
        self._batches = tuple(Counter(sizes) for sizes in now_sizes)
        used, total = self.voice.kv_blocks()
        stats = VoiceStats(used, total, len(self.answers), talker, code2wav, self._first_audio, self._cancelled)
        self._first_audio, self._cancelled, self._published_at, self._dirty = [], 0, now, False
        self.publish(stats)

    def _loop(self) -> None:
        while True:
            try:
                if not self.run_once(block=True):
                    return
            except Exception as exc:  # a talker or code2wav fault (out of memory, a device error): the answers in
                # progress end with an error and the stage goes on serving; the thread must not die, or every
                # later request would wait forever on a model that still looks ready
                logger.exception("the voice step failed; ending the %d answers in progress", len(self.answers))
                self._fail_all(f"the voice stage failed: {exc}")

    def _fail_all(self, error: str) -> None:
        """End every answer in progress with `error` (delivered now, or at its next request)."""
        for key in list(self.answers):
            self.voice.abort(key)
            self._started.pop(key, None)
            self._deliver(Chunk(key, -1, torch.zeros(0), True, error))

    def _apply(self, request: VoiceRequest, sink: ChunkSink) -> None:
        if request.kind == "cancel":
            self.voice.abort(request.key)
            self._started.pop(request.key, None)
            answer = self.answers.pop(request.key, None)
            self._cancelled += answer is not None
            if answer is not None and answer.listener is not None:
                answer.listener.close()
            sink.close()
            return
        try:
            if request.key not in self.answers:
                if request.voice is None or request.prompt_tokens is None:
                    raise FieldError(T.STREAM_KEY, f"{request.key!r} names no answer in progress (its first request "
                                     f"carries voice and prompt_tokens; a cancelled or failed answer is gone)")
                seed = random.getrandbits(63) if request.seed is None else request.seed
                self.voice.start(request.key, request.voice, seed, request.prompt_tokens, request.prompt_positions,
                                 request.media_positions)
                self.answers[request.key] = _Answer()
                self._started[request.key] = time.monotonic()
            self.voice.push(request.key, request.hidden, request.embeds, request.finished)
        except Exception as exc:  # bad rows or a refused start: this answer ends
            self.voice.abort(request.key)
            self._started.pop(request.key, None)
            self.answers.pop(request.key, None)
            sink.fail(exc)
            return
        answer = self.answers[request.key]
        if request.finished:
            answer.listener = sink
        pending, answer.pending = answer.pending, []
        if answer.ended or not pending:
            if answer.ended and request.finished:
                del self.answers[request.key]
            if answer.ended or not request.finished:
                sink.close()
            return
        for chunk in pending:
            self._deliver(chunk, sink, final_flag=not request.finished and chunk is pending[-1])

    def _deliver(self, chunk: Chunk, sink: ChunkSink | None = None, final_flag: bool = False) -> None:
        """A chunk to `sink` (the final flag with the answer's last chunk, or with `final_flag`), else to its
        answer's listener, else held until its answer's next request."""
        answer = self.answers.get(chunk.request_id)
        if answer is None or answer.ended:
            return
        sink = sink or answer.listener
        if sink is None:
            answer.pending.append(chunk)
            return
        if chunk.final:
            answer.ended = True
            if answer.listener is not None or chunk.error:  # its last request has come, or its asker stops at
                del self.answers[chunk.request_id]            # the error: nothing more will ask for it
        if chunk.error:
            sink.fail(StageError(ErrorKind.INTERNAL, chunk.error))
        else:
            sink.send(chunk_arrays(chunk, self.sample_rate), final=chunk.final or final_flag)


def has_talker(folder: str | Path) -> bool:
    """Whether the checkpoint folder speaks with its own voice: its architecture has a talker (engine/models/
    registry.py) and the folder has its voices (spk_dict.pt). A folder without a readable config.json has none."""
    try:
        names = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
        architecture = registry.lookup(names[0]) if names else None
    except (OSError, ValueError):
        return False
    return (architecture is not None and architecture.talker_architecture is not None
            and (Path(folder) / SPEAKER_FILE).is_file())


def build_worker(parameters: dict[str, str], publish: Callable[[VoiceStats], None] | None = None
                 ) -> VoiceWorker | None:
    """The voice model's worker from its string parameters: `model_path` (the llm's checkpoint), `device`, `dtype`
    and the `talker_<field>` / `code2wav_<field>` settings; None when the checkpoint has no talker (the model then
    answers every request UNAVAILABLE, and the entry points speak with the tts stage). `publish`: where the
    worker's metrics snapshots go.

    Raises:
        ValueError: a setting's value that is not allowed; what `OmniVoice` raises for a broken checkpoint.
    """
    from omni_backend.engine.config import EngineConfig
    from omni_backend.ops.hardware import resolve_device
    from omni_backend.stages.omni_voice import OmniVoice

    folder, device, dtype = (parse_field(EngineConfig, name, parameters.get(name))
                             for name in ("model_path", "device", "dtype"))
    talker = TalkerSettings.from_strings(parameters, TalkerSettings.PREFIX)
    code2wav = Code2WavSettings.from_strings(parameters, Code2WavSettings.PREFIX)
    if not has_talker(folder):
        return None
    voice = OmniVoice(folder, talker, code2wav, device=resolve_device(device), dtype=dtype)
    return VoiceWorker(voice, tuple(voice.inputs.speakers.table), voice.code2wav.sample_rate, publish=publish)
