"""A chat answer spoken in the served model's own voice, as an entry point runs it (stages/entry_points.py, when its
`voice_model` is set: the llm's checkpoint has a talker): the llm stage streams text together with the thinker's
rows (`return_hidden_states`), every llm response's rows go to the voice stage (stages/voice.py) under the answer's
key, and what comes back reaches the client as soon as it comes.

The client's responses (the entry point's outputs):

    text        each llm response's text delta: `text_output`, `finish_reason` ""
    audio       each waveform chunk: `waveform` FP32 [n] as the voice made it, `audio` INT16 [n] (the same samples,
                16-bit), `sample_rate`, `chunk_index`, `text_output` "", `finish_reason` ""
    last        after the answer's last chunk: `text_output` "", the llm's `finish_reason` and token counts

The voice is checked by the voice stage before the llm runs; a speed other than 1 is refused (the talker speaks at
its own pace).
"""

from __future__ import annotations

import json
from typing import Protocol

import numpy as np

from omni_backend import tensor_names as T
from omni_backend.stages.tensors import one_value, string_tensor
from omni_backend.stages.tts import COUNT_NAMES
from omni_backend.stages.tts_options import check_format, check_speed
from omni_backend.vocabulary import FieldError


class Client(Protocol):
    """The entry point's request as this module uses it (`entry_points._Request`)."""

    request_id: str
    cancelled: bool
    finished: bool

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None: ...


def check_options(stages, model: str, arrays: dict[str, np.ndarray], request_id: str) -> None:
    """Check a spoken answer's `voice` (asking the voice stage), `audio_format` and `speed` before the llm runs.

    Raises:
        StageFailure: the voice stage refused the voice (its message names `voice` and the model's voices).
        FieldError: a format that is not supported, a speed other than 1.
    """
    check_format(one_value(arrays, T.AUDIO_FORMAT, str))
    if check_speed(one_value(arrays, T.SPEED, float)) != 1.0:
        raise FieldError(T.SPEED, "must be 1 for a model that speaks with its own voice (its talker sets the pace)")
    if T.VOICE not in arrays:
        raise FieldError(T.VOICE, "is required for a spoken answer")
    for _ in stages.stream(model, {T.VOICE: arrays[T.VOICE]}, (), request_id):
        pass


def with_hidden_states(sampling_params: np.ndarray) -> tuple[np.ndarray, int | None]:
    """The llm's sampling params (STRING [1], JSON) asking for the thinker's rows and streamed responses, and the
    request's seed (None: unseeded), which the voice stage also uses."""
    params = json.loads(one_value({T.SAMPLING_PARAMS: sampling_params}, T.SAMPLING_PARAMS, str))
    params.update(return_hidden_states=True, stream=True)
    return string_tensor(json.dumps(params)), params.get("seed")


def to_int16(waveform: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] as 16-bit PCM (clipped, rounded)."""
    return np.clip(np.rint(np.asarray(waveform, np.float64) * 32767), -32768, 32767).astype(np.int16)


class VoiceAnswer:
    """One answer's way through the voice stage (module docstring).

    Args:
        stages: the entry point's `Stages`.
        model: the voice stage's model name.
        client: the entry point's request.
        key: the answer's key (the llm generation's stream_key).
        voice: the voice tensor (STRING [1]), seed: the llm request's seed or None.
        prompt_positions: the M-RoPE ids of a prompt with media (INT32 [3, n]) or None.
        media_positions: the prompt positions of its image, audio and video placeholders (INT32 [k], media_embed's
            `prompt_embed_positions`: the talker reads their input embeddings as zero) or None.
    """

    def __init__(self, stages, model: str, client: Client, key: str, voice: np.ndarray, seed: int | None,
                 prompt_positions: np.ndarray | None = None, media_positions: np.ndarray | None = None):
        self.stages, self.model, self.client = stages, model, client
        self.key = np.array([key.encode()], dtype=np.object_)
        self.first = {T.VOICE: voice, **({T.SEED: np.array([seed], np.int64)} if seed is not None else {})}
        for name, array in ((T.PROMPT_POSITIONS, prompt_positions), (T.MEDIA_POSITIONS, media_positions)):
            if array is not None and array.size:
                self.first[name] = array
        self.started = False  # its first request went to the voice stage
        self.ended = False  # its last request was answered to the end

    def speak(self, response: dict[str, np.ndarray]) -> None:
        """One llm response: its text to the client, its rows to the voice stage and the chunks ready to the client;
        after the llm's last response, every chunk to the last, then the client's last response. Returns early when
        the client cancels.

        Raises:
            StageFailure: the voice stage's error (`cancel` still frees the answer; a no-op if the stage ended it).
        """
        finish = one_value(response, T.FINISH_REASON, str, "")
        text = one_value(response, T.TEXT_OUTPUT, str, "")
        if text:
            self.client.send({T.TEXT_OUTPUT: string_tensor(text), T.FINISH_REASON: string_tensor("")}, False)
        inputs = {T.STREAM_KEY: self.key, T.FINISH_REASON: response[T.FINISH_REASON],
                  **{name: response[name] for name in (T.HIDDEN_STATES, T.INPUT_EMBEDS) if name in response}}
        if not self.started:
            inputs.update(self.first, **{T.PROMPT_TOKENS: response[T.PROMPT_TOKENS]})
        self.started = True
        chunks = self.stages.stream(self.model, inputs, (), self.client.request_id)
        try:
            for chunk in chunks:
                if self.client.cancelled:
                    self.cancel()  # before closing `chunks`, which waits for the voice stream's end
                    return
                waveform = chunk[T.WAVEFORM].reshape(-1)
                self.client.send({T.TEXT_OUTPUT: string_tensor(""), T.WAVEFORM: waveform, T.AUDIO: to_int16(waveform),
                                  T.SAMPLE_RATE: chunk[T.SAMPLE_RATE], T.CHUNK_INDEX: chunk[T.CHUNK_INDEX],
                                  T.FINISH_REASON: string_tensor("")}, False)
        finally:  # on a failure `ended` stays False, so the cancel still goes (a no-op if the stage ended it)
            chunks.close()
        if finish and not self.client.cancelled:
            self.ended = True
            self.client.send({T.TEXT_OUTPUT: string_tensor(""), T.FINISH_REASON: response[T.FINISH_REASON],
                              **{name: response[name] for name in COUNT_NAMES if name in response}}, True)

    def cancel(self) -> None:
        """End the answer in the voice stage (both engines' KV freed) unless its last request was answered."""
        if self.started and not self.ended:
            self.ended = True
            for _ in self.stages.stream(self.model, {T.CANCEL: self.key}, (), self.client.request_id):
                pass
