"""The `voice` stage over gRPC (omni_backend/stages/voice.py): the served model's own voice, fed the thinker's rows of
an answer request by request, its waveform chunks back as they are made."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from omni_backend import tensor_names as T
from omni_backend.serving import errors
from omni_backend.serving.speech_backend import Audio
from omni_backend.serving.triton_client import TritonGrpcUser, stream_one
from omni_backend.stages.tensors import string_tensor
from omni_backend.stages.voice_answer import to_int16

logger = logging.getLogger(__name__)

VOICE_MODEL = "voice"
NO_VOICE_RECHECK_S = 30.0  # how long "this model has no voice of its own" is believed before asking again


_CANCELS: set[asyncio.Task] = set()  # cancels running on after their caller was cancelled


def _cancel_done(call: asyncio.Task) -> None:
    _CANCELS.discard(call)
    if not call.cancelled() and call.exception() is not None:
        logger.error("cancelling a voice answer failed: %s", call.exception())


@dataclass
class VoiceChunk:
    """A waveform chunk: `audio` (16-bit, as the answer's formats take it), its float samples `waveform` in [-1, 1],
    and whether it is the answer's last (`final`)."""

    audio: Audio
    waveform: np.ndarray
    final: bool


class VoiceBackend(TritonGrpcUser):
    """The voice stage's requests (stages/voice.py's module docstring), each one gRPC stream.

    Args:
        grpc_url: Triton's gRPC address.
        model: the voice stage's model name.
    """

    def __init__(self, grpc_url: str, model: str = VOICE_MODEL):
        super().__init__(grpc_url)
        self.model = model
        self._voices: tuple[str, ...] | None = None
        self._none_until = 0.0  # no own voice believed until then

    async def voices(self) -> tuple[str, ...] | None:
        """The served model's own voices, or None: it has no talker (the voice stage answers UNAVAILABLE, or is not
        loaded), so the tts stage speaks its answers. A list once learned is kept; None is asked again after
        NO_VOICE_RECHECK_S."""
        if self._voices is not None or time.monotonic() < self._none_until:
            return self._voices
        try:
            async for outputs in self._stream({T.VOICE: string_tensor("")}, ""):
                self._voices = tuple(json.loads(outputs[T.VOICE].reshape(-1)[0]))
        except (errors.OpenAIError, InferenceServerException):  # stream_one maps gRPC's own errors to OpenAIError
            self._none_until = time.monotonic() + NO_VOICE_RECHECK_S
        return self._voices

    async def chunks(self, inputs: dict[str, np.ndarray], request_id: str = "") -> AsyncIterator[VoiceChunk]:
        """One request of an answer (its rows, and on its first the voice, seed and prompt length): the chunks it is
        answered with. Closing the iterator early cancels the gRPC stream only; `cancel` ends the answer.

        Raises:
            OpenAIError: the stage's error (400 naming `audio.voice` for a voice the model lacks, 500 for a talker
                or code2wav failure, 503 when unavailable).
        """
        async for outputs in self._stream(inputs, request_id):
            waveform = outputs[T.WAVEFORM].reshape(-1)
            yield VoiceChunk(Audio(to_int16(waveform), int(outputs[T.SAMPLE_RATE].reshape(-1)[0])), waveform,
                             bool(outputs[T.FINISH_REASON].reshape(-1)[0]))

    async def cancel(self, key: str, request_id: str = "") -> None:
        """End the answer `key` in the voice stage (its KV blocks freed), also when the caller is cancelled meanwhile
        (a client that went away: its task is cancelled at every await, so the cancel runs as a task of its own,
        which a failure only logs)."""
        call = asyncio.ensure_future(self._cancel(key, request_id))
        _CANCELS.add(call)
        call.add_done_callback(_cancel_done)
        await asyncio.shield(call)

    async def _cancel(self, key: str, request_id: str) -> None:
        async for _ in self._stream({T.CANCEL: string_tensor(key)}, request_id):
            pass

    async def _stream(self, inputs: dict[str, np.ndarray], request_id: str) -> AsyncIterator[dict[str, np.ndarray]]:
        tensors = []
        for name, array in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)

        # a request of an answer may end with the final flag alone: this makes Triton send it
        request = {"model_name": self.model, "inputs": tensors, "request_id": request_id,
                   "parameters": {"triton_enable_empty_final_response": True}}
        async for result in stream_one(
                self.client, request,
                lambda message: errors.from_triton(message, None, None,
                                                   lambda name: "audio.voice" if name == T.VOICE else name),
                lambda result: result.get_response().parameters["triton_final_response"].bool_param):
            response = result.get_response()
            if response.outputs:
                yield {output.name: result.as_numpy(output.name) for output in response.outputs}
