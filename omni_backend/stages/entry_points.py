"""The streaming entry points `omni_chat`, `omni_chat_mm` and `omni_speech`: decoupled Python models that run their
pipeline's stages for each request (BLS) and end what they started when the client cancels.

Why not ensembles: Triton cancels an ensemble request only between its steps (a step scheduled after the
cancellation is cancelled in its queue: core's ensemble_scheduler.cc, PR triton-inference-server/core#263), never a
request already inside a step, in 2.51 as in Triton's main branch; so a cancelled ensemble stream left the decoupled
llm step generating, and holding KV blocks, until max_tokens (seen: `omni_requests_running` still 1 and the KV blocks
in use still growing 10 s after the cancel). A Python model sees its own request's cancellation
(`is_cancelled()`: a gRPC stream the client cancelled, an HTTP `generate_stream` whose client went away, which 2.51
notices when it writes the next response) and ends the llm request it started.

Ending a child request: python_backend 24.10 (Triton 2.51) cannot cancel a request a Python model sent (the response
iterator of `exec(decoupled=True)` gets `cancel()` only in python_backend r25.04, PR
triton-inference-server/python_backend#398), so the llm stage offers a side channel that works on every release:
each generation goes out with a fresh `stream_key`, and a request whose `cancel` input is that key ends it exactly as
a cancelled client stream does (aborted, KV blocks freed, its stream ended with the final flag).

One request (`EntryPoint.run`, on a thread of its own; the stage models are named by the config's `*_model`
parameters, `Steps`):

    omni_chat      preprocess -> llm -> postprocess
    omni_chat_mm   preprocess -> media_embed (only for a request with image/audio parts) -> llm -> postprocess
    omni_speech    speech_options, preprocess -> media_embed (as omni_chat_mm's) -> llm -> tts (once per llm
                   response, in order); when the served model has a talker (its `voice_model` is set): voice check,
                   preprocess -> media_embed -> llm (with the thinker's rows) -> voice (once per llm response, in
                   order, the first with the prompt's M-RoPE ids and media positions; stages/voice_answer.py)

Tensors go from stage to stage by name. postprocess only rewrites logprobs, so an llm response without them skips
it (`carries_logprobs`). A response with a non-empty `finish_reason` is the request's last and carries the final
flag. A stage's error reaches the client as that stage's message (its `StageError` header intact) and Triton code.

Cancellation: a watch thread asks every request's response sender `is_cancelled()` (an IPC round trip each) every
CANCEL_POLL_INTERVAL_S, or less often while a round takes long. A cancelled request sends nothing more and calls no
further stage; its llm generation gets a cancel request (from the watch, and once more from the request's thread at
the next llm response, for a cancel that overtook its generation and found nothing), and once the llm stream has
ended the client's stream ends with the final flag alone.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, fields
from typing import Generator, Protocol

import numpy as np

from omni_backend import tensor_names as T
from omni_backend.stages.postprocess import INPUT_NAMES as POSTPROCESS_INPUTS
from omni_backend.stages.postprocess import carries_logprobs
from omni_backend.stages.tensors import one_value
from omni_backend.stages.tts import COUNT_NAMES as TTS_COUNTS
from omni_backend.stages.tts_options import SPEECH_OPTION_INPUTS
from omni_backend.stages.voice_answer import VoiceAnswer, check_options, with_hidden_states
from omni_backend.vocabulary import ErrorKind, StageError

logger = logging.getLogger(__name__)

CANCEL_POLL_INTERVAL_S = 0.1
# a round of `is_cancelled` calls is spaced at least this many times its own duration (polling <= 1/5 of a core)
CANCEL_POLL_SPACING = 4
LLM_OUTPUTS = POSTPROCESS_INPUTS  # what the entry points take from the llm stage
MEDIA_INPUTS = (T.PIXEL_VALUES, T.INPUT_FEATURES, T.MEDIA_PARTS, T.MEDIA_POSITIONS)  # media_embed's inputs


@dataclass(frozen=True)
class Steps:
    """The stage models an entry point calls: its config's `<role>_model` parameters (`preprocess_model`, ...).

    Attributes:
        preprocess, llm: always.
        postprocess: the model that rewrites logprobs, or None (a pipeline whose requests never ask for them).
        media: the media_embed model (image/audio parts to llm prompt embeddings), or None.
        speech_options: the model that checks voice/format/speed and gives the tts options, or None.
        tts: the text-to-speech model the llm's text goes to, or None (then the answer is text).
        voice: the model that speaks with the served model's own voice (its talker; stages/voice.py), or None; when
            set it speaks instead of speech_options and tts.
    """

    preprocess: str
    llm: str
    postprocess: str | None = None
    media: str | None = None
    speech_options: str | None = None
    tts: str | None = None
    voice: str | None = None

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> "Steps":
        """The steps named by `<role>_model` parameters (a Triton config's string parameters).

        Raises:
            ValueError: preprocess_model or llm_model missing, speech_options_model without
                tts_model (or the reverse), or a `*_model` parameter of no known role.
        """
        roles = [f.name for f in fields(cls)]
        given = {key.removesuffix("_model"): value for key, value in parameters.items()
                 if key.endswith("_model") and value}
        unknown = sorted(set(given) - set(roles))
        if unknown:
            raise ValueError(f"unknown step parameter(s): {', '.join(r + '_model' for r in unknown)}; known: "
                             f"{', '.join(r + '_model' for r in roles)}")
        missing = [role + "_model" for role in ("preprocess", "llm") if role not in given]
        if missing:
            raise ValueError(f"missing step parameter(s): {', '.join(missing)}")
        if ("speech_options" in given) != ("tts" in given):
            raise ValueError("speech_options_model and tts_model go together")
        return cls(**given)


class StageFailure(Exception):
    """A stage answered with an error: its message (with its StageError header, if any) and its Triton error code,
    which go to the client unchanged."""

    def __init__(self, message: str, code):
        super().__init__(message)
        self.message, self.code = message, code


class Stages(Protocol):
    """The stage models, as an entry point calls them (omni_backend/stages/bls.py over Triton, lists in tests)."""

    def infer(self, model: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...],
              request_id: str) -> dict[str, np.ndarray]:
        """One request to a model that answers once; its `outputs` (those it sent).

        Raises:
            StageFailure: the model answered with an error.
        """

    def stream(self, model: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...],
               request_id: str) -> Generator[dict[str, np.ndarray], None, None]:
        """One request to a decoupled model: the `outputs` of each of its responses, in order, until its final flag
        (a final flag sent alone yields nothing). Closed early, it returns once the model has ended the stream (the
        caller has asked it to).

        Raises:
            StageFailure: the model answered with an error.
        """


class Client(Protocol):
    """The entry point's own request, as seen from its thread (a Triton response sender in production)."""

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None: ...

    def fail(self, error: StageFailure | StageError) -> None:
        """One error response, with the final flag."""

    def close(self) -> None:
        """The final flag alone (the request was cancelled)."""

    def is_cancelled(self) -> bool: ...


class _Request:
    """One entry point request in flight: its client, and what the watch and its thread share about it.

    Its final flag goes out under `lock`, the lock the watch holds while it asks `is_cancelled`, and the watch asks
    only before it: in python_backend 24.10 (as in its main branch) `is_cancelled()` on a response sender whose
    final flag has gone uses the freed response factory, and tritonserver dies (SIGSEGV in
    TRITONBACKEND_ResponseFactoryIsCancelled, seen here in a storm of cancels).
    """

    def __init__(self, request_id: str, client: Client):
        self.request_id, self.client = request_id, client
        self.lock = threading.Lock()
        self.cancelled = False
        self.finished = False  # the client's final flag has gone (or failed to: the sender is closed either way)
        self.stream_key: str | None = None  # set when its llm generation is sent

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None:
        if not final:
            self.client.send(outputs, False)
            return
        with self.lock:
            try:
                self.client.send(outputs, True)
            finally:
                self.finished = True

    def end(self, error: StageFailure | StageError | None) -> None:
        """The final flag, with `error` (None: alone, after a cancellation)."""
        with self.lock:
            try:
                if error is None:
                    self.client.close()
                else:
                    self.client.fail(error)
            finally:
                self.finished = True

    def poll_cancelled(self) -> bool:
        """Ask the client whether it cancelled (at most once the answer is yes, never after the final flag); True
        when it newly did."""
        with self.lock:
            if self.finished or self.cancelled or not self.client.is_cancelled():
                return False
            self.cancelled = True
            return True


class EntryPoint:
    """Runs one entry point's requests, each on its own thread, and watches them for cancellation.

    Args:
        name: the entry point's model name (in errors, logs and the llm stream keys).
        steps: its stage models.
        stages: how to call them.
        poll_interval_s: the shortest time between two rounds of `is_cancelled` calls.
    """

    def __init__(self, name: str, steps: Steps, stages: Stages, poll_interval_s: float = CANCEL_POLL_INTERVAL_S):
        self.name, self.steps, self.stages = name, steps, stages
        self.poll_interval_s = poll_interval_s
        self._requests: set[_Request] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watch = threading.Thread(target=self._watch_loop, name=f"{name}-cancel-watch", daemon=True)
        self._watch.start()

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._requests)

    def submit(self, arrays: dict[str, np.ndarray], client: Client, request_id: str = "") -> threading.Thread:
        """Start one request: `arrays` are its inputs by tensor name, its responses go to `client`; its stage
        requests carry `request_id`. Returns its thread."""
        request = _Request(request_id, client)
        with self._lock:
            self._requests.add(request)
        thread = threading.Thread(target=self.run, args=(request, arrays), name=f"{self.name}-request", daemon=True)
        thread.start()
        return thread

    def shutdown(self) -> None:
        """Stop the watch thread (requests still running end with their llm streams)."""
        self._stopping.set()
        self._watch.join(timeout=5)

    def run(self, request: _Request, arrays: dict[str, np.ndarray]) -> None:
        """The whole of one request (see the module docstring); every way out ends the client's stream once."""
        error: StageFailure | StageError | None = None
        try:
            self._pipeline(request, arrays)
        except (StageFailure, StageError) as failure:  # a stage's answer, or a request this entry point refuses
            error = failure
        except Exception as exc:  # a fault here fails this request only
            logger.exception("%s request %s failed", self.name, request.request_id)
            error = StageError.of(exc, self.name)
        finally:
            with self._lock:
                self._requests.discard(request)
        try:
            if request.finished:
                return
            if request.cancelled:
                request.end(None)
            else:
                request.end(error or StageError(ErrorKind.INTERNAL, f"the {self.steps.llm} stream ended before its "
                                                                    "final response"))
        except Exception:  # the client is gone either way
            logger.exception("ending %s request %s failed", self.name, request.request_id)

    def _pipeline(self, request: _Request, arrays: dict[str, np.ndarray]) -> None:
        """Run the stages until the client got its last response, the request was cancelled or the llm stream
        ended without a last response. Leaving early (cancelled, or any error) cancels the llm generation.

        Raises:
            StageFailure: a stage's error.
        """
        steps, stages, rid = self.steps, self.stages, request.request_id
        options = None
        if steps.voice is not None:
            check_options(stages, steps.voice, arrays, rid)
        elif steps.speech_options is not None:
            given = {name: arrays[name] for name in SPEECH_OPTION_INPUTS if name in arrays}
            options = stages.infer(steps.speech_options, given, (T.OPTIONS,), rid)[T.OPTIONS]
        wanted = (T.INPUT_IDS, T.SAMPLING_PARAMS, T.MEDIA_PARTS) + ((*MEDIA_INPUTS, T.PROMPT_POSITIONS)
                                                                   if steps.media else ())
        prepared = stages.infer(steps.preprocess, {k: v for k, v in arrays.items() if k not in SPEECH_OPTION_INPUTS},
                                wanted, rid)
        llm_inputs = {T.INPUT_IDS: prepared[T.INPUT_IDS], T.SAMPLING_PARAMS: prepared[T.SAMPLING_PARAMS]}
        has_media = bool(json.loads(one_value(prepared, T.MEDIA_PARTS, str, "[]")))
        if has_media and steps.media is None:  # the placeholders would reach the llm without their embeddings
            raise StageError(ErrorKind.INVALID_ARGUMENT, f"{T.TEXT_INPUT} has image, audio or video parts: "
                             f"{self.name} takes text only (send them to omni_chat_mm, or to omni_speech for a "
                             "spoken answer)",
                             T.TEXT_INPUT)
        if has_media:
            llm_inputs.update(stages.infer(steps.media, {k: prepared[k] for k in MEDIA_INPUTS},
                                           (T.PROMPT_EMBEDS, T.PROMPT_EMBED_POSITIONS), rid))
        positions = prepared.get(T.PROMPT_POSITIONS)
        if positions is not None and positions.size:  # M-RoPE ids of a Qwen2.5-Omni prompt with media
            llm_inputs[T.PROMPT_POSITIONS] = positions
        key = f"{self.name}-{uuid.uuid4().hex}"
        with request.lock:
            if request.cancelled:
                return
            request.stream_key = key
        llm_inputs[T.STREAM_KEY] = np.array([key.encode()], dtype=np.object_)
        spoken = None
        if steps.voice is not None:
            llm_inputs[T.SAMPLING_PARAMS], seed = with_hidden_states(llm_inputs[T.SAMPLING_PARAMS])
            spoken = VoiceAnswer(stages, steps.voice, request, key, arrays[T.VOICE], seed,
                                 llm_inputs.get(T.PROMPT_POSITIONS), llm_inputs.get(T.PROMPT_EMBED_POSITIONS))
        # every output for a spoken answer: hidden_states and input_embeds come only with return_hidden_states
        responses = stages.stream(steps.llm, llm_inputs, () if spoken else LLM_OUTPUTS, rid)
        llm_ended = False
        try:
            for response in responses:
                if request.cancelled:
                    return
                if steps.postprocess is not None and carries_logprobs(response):
                    response = stages.infer(steps.postprocess, response, POSTPROCESS_INPUTS, rid)
                final = bool(one_value(response, T.FINISH_REASON, str, ""))
                if spoken is not None:
                    spoken.speak(response)
                elif steps.tts is None:
                    request.send(response, final)
                else:
                    self._speak(request, response, options)
                if request.finished or request.cancelled:
                    llm_ended = final
                    return
            llm_ended = True
        finally:
            if not llm_ended:  # the watch may have sent it already, maybe before the generation was there
                self._cancel_llm(request)
            responses.close()
            if spoken is not None:
                self._cancel_voice(spoken)

    def _speak(self, request: _Request, response: dict[str, np.ndarray], options: np.ndarray) -> None:
        """Send one llm response's text to tts and its phrases to the client, until one is final or the request is
        cancelled."""
        inputs = {T.TEXT: response[T.TEXT_OUTPUT], T.FINISH_REASON: response[T.FINISH_REASON], T.OPTIONS: options,
                  **{name: response[name] for name in TTS_COUNTS if name in response}}
        phrases = self.stages.stream(self.steps.tts, inputs, (), request.request_id)
        try:
            for phrase in phrases:
                if request.cancelled:
                    return
                request.send(phrase, bool(one_value(phrase, T.FINISH_REASON, str, "")))
                if request.finished:
                    return
        finally:
            phrases.close()

    def _cancel_llm(self, request: _Request) -> None:
        """Send the llm stage a cancel request for the request's generation. A failure is logged: the llm stream
        then runs to its end."""
        key = np.array([request.stream_key.encode()], dtype=np.object_)
        try:
            for _ in self.stages.stream(self.steps.llm, {T.CANCEL: key}, (), request.request_id):
                pass
        except Exception:
            logger.exception("cancelling the %s generation of %s request %s failed", self.steps.llm, self.name,
                             request.request_id)

    def _cancel_voice(self, spoken: VoiceAnswer) -> None:
        """End a spoken answer that did not reach its last chunk in the voice stage. A failure is logged: the voice
        stage then speaks it to its end."""
        try:
            spoken.cancel()
        except Exception:
            logger.exception("cancelling the %s answer of %s request %s failed", self.steps.voice, self.name,
                             spoken.client.request_id)

    def _watch_loop(self) -> None:
        while not self._stopping.is_set():
            began = time.monotonic()
            try:
                self.poll_cancellations()
            except Exception:  # the watch must never stop
                logger.exception("%s: polling for cancellations failed", self.name)
            took = time.monotonic() - began
            self._stopping.wait(max(self.poll_interval_s, CANCEL_POLL_SPACING * took))

    def poll_cancellations(self) -> None:
        """One round of the watch: mark the requests whose client cancelled, and cancel their llm generations."""
        with self._lock:
            live = [r for r in self._requests if not r.cancelled and not r.finished]
        for request in live:
            try:  # one failing poll must not hide the others' cancellations
                if request.poll_cancelled() and request.stream_key is not None:
                    self._cancel_llm(request)
            except Exception:
                logger.exception("%s: polling request %s for cancellation failed", self.name, request.request_id)
