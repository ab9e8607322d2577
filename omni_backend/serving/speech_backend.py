"""The `tts` stage over gRPC (omni_backend/stages/tts.py): text in, the audio of each phrase out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np
import tritonclient.grpc as grpcclient

from omni_backend import tensor_names as T
from omni_backend.serving import errors
from omni_backend.serving.triton_client import TritonGrpcUser, stream_one
from omni_backend.stages.tts_options import SpeechOptions

TTS_MODEL = "tts"
STAGE = "tts"  # its name in the front door's `stage_endpoints` setting
# The tts stage's fields -> the OpenAI /v1/audio/speech fields (its `text` is named by the caller).
_OPTION_FIELDS = {"options.voice": "voice", "options.audio_format": "response_format", "options.speed": "speed"}


@dataclass
class Audio:
    """Speech: int16 mono `samples` at `rate` Hz."""

    samples: np.ndarray
    rate: int

    @classmethod
    def joined(cls, pieces: list[Audio], empty_rate: int = 0) -> Audio:
        """`pieces` one after the other, at the last one's rate (no pieces: no samples, at `empty_rate`)."""
        if not pieces:
            return cls(np.zeros(0, np.int16), empty_rate)
        return cls(np.concatenate([piece.samples for piece in pieces]), pieces[-1].rate)


class SpeechBackend(TritonGrpcUser):
    """Self-contained tts requests: one gRPC stream per piece of text, one response per phrase."""

    def __init__(self, grpc_url: str, model: str = TTS_MODEL):
        super().__init__(grpc_url)
        self.model = model

    async def phrases(self, text: str, options: SpeechOptions, field: str = "input",
                      request_id: str = "") -> AsyncIterator[Audio]:
        """Speak `text`; yields the Audio of each phrase in order.

        Closing the iterator early cancels the request.

        Raises:
            OpenAIError: 400 for the stage's INVALID_ARGUMENT (naming `field` for the text); 503 naming the stage
                when its tritonserver is unavailable (down: gRPC fails the call at once); 503/500 otherwise.
        """
        tensors = []
        for name, value in ((T.TEXT, text), (T.OPTIONS, options.to_json())):
            tensor = grpcclient.InferInput(name, [1], "BYTES")
            tensor.set_data_from_numpy(np.array([value.encode("utf-8")], dtype=np.object_))
            tensors.append(tensor)

        request = {"model_name": self.model, "inputs": tensors, "request_id": request_id}
        finished = False
        async for result in stream_one(
                self.client, request, lambda message: errors.from_triton(
                    message, None, None, lambda name: field if name == T.TEXT else _OPTION_FIELDS.get(name, name)),
                lambda result: bool(result.as_numpy(T.FINISH_REASON).reshape(-1)[0]), (STAGE, self.grpc_url)):
            finished = bool(result.as_numpy(T.FINISH_REASON).reshape(-1)[0])
            yield Audio(result.as_numpy(T.AUDIO).reshape(-1).astype(np.int16),
                        int(result.as_numpy(T.SAMPLE_RATE).reshape(-1)[0]))
        if not finished:
            raise errors.internal(f"the {self.model} stream ended before its final response")

    async def speak(self, text: str, options: SpeechOptions, field: str = "input") -> Audio:
        """The whole audio of `text`."""
        return Audio.joined([audio async for audio in self.phrases(text, options, field)])
