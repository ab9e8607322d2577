"""A chat answer spoken in the served model's own voice (a checkpoint with a talker, Qwen2.5-Omni): the llm stage
streams the text together with the thinker's rows (`Step.rows`), each step's rows go to the voice stage
(serving/voice_backend.py) under the answer's key, and its waveform chunks reach the client as they come, while the
thinker goes on. The answer is shaped as `SpokenAnswer`'s (serving/spoken.py): `message.audio` with the transcript,
or streamed transcript and pcm16 audio deltas.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import AsyncIterator

import numpy as np

from omni_backend import tensor_names as T
from omni_backend.serving import errors
from omni_backend.serving.generation import Choice, Generation
from omni_backend.serving.pipeline import Step
from omni_backend.serving.speech_backend import Audio
from omni_backend.serving.spoken import SpokenAnswer
from omni_backend.serving.voice_backend import VoiceBackend
from omni_backend.stages.tensors import string_tensor
from omni_backend.stages.tts_options import SpeechOptions


class VoicedAnswer(SpokenAnswer):
    """The spoken side of one chat answer in the model's own voice (one choice).

    Args:
        backend: the voice stage.
        options: the voice (one of the model's) and the audio format.
        seed: the request's seed (talker sampling and code2wav noise), None: a random one.
    """

    def __init__(self, backend: VoiceBackend, options: SpeechOptions, seed: int | None = None):
        super().__init__(backend, options)
        self.seed = seed

    async def merged(self, generation: Generation) -> AsyncIterator[tuple[Choice, Step | Audio]]:
        """The generation's text steps and the Audio of each chunk as soon as the voice makes it; the last step's
        finish reason after the last chunk. Closing this stops the llm and ends the answer in the voice stage (both
        engines' KV freed).

        Raises:
            OpenAIError: from the pipeline or the voice stage.
        """
        choice = generation.choices[0]
        key = f"voiced-{uuid.uuid4().hex}"
        held = False  # the voice stage holds the answer: it has not had its last request, nor failed
        try:
            async for _, step in generation.merged():
                if step.text:
                    yield choice, replace(step, finish_reason=None, rows={})
                inputs = {T.STREAM_KEY: string_tensor(key), T.FINISH_REASON: string_tensor(step.finish_reason or ""),
                          **step.rows}
                if not held:
                    inputs.update(self._first(choice, step))
                    held = True
                # a failure here may come from anywhere between us and the stage: the cancel in `finally` still
                # goes (an answer the stage already ended makes it a no-op), so no talker KV is left held
                async for chunk in self.backend.chunks(inputs, generation.request_id):
                    yield choice, chunk.audio
                if step.finish_reason:
                    held = False  # its last request has been answered to the end
                    yield choice, replace(step, text="", logprobs=None, rows={})
                    return
            raise errors.internal("the chat stream ended before its final response")
        finally:
            try:
                if held:
                    await self.backend.cancel(key, generation.request_id)
            finally:
                await generation.close()

    def _first(self, choice: Choice, step: Step) -> dict[str, np.ndarray]:
        """The first request's extras: voice, seed, the thinker prompt's length, its M-RoPE ids and its media
        placeholders' positions (a prompt with media)."""
        extra = {T.VOICE: string_tensor(self.options.voice), T.PROMPT_TOKENS: np.array([step.prompt_tokens], np.int32)}
        if self.seed is not None:
            extra[T.SEED] = np.array([self.seed], np.int64)
        positions = choice.prepared.tensors.get(T.PROMPT_POSITIONS)
        if positions is not None and positions.size:
            extra[T.PROMPT_POSITIONS] = positions
        media = choice.prepared.extra.get(T.PROMPT_EMBED_POSITIONS)
        if media is not None and media.size:
            extra[T.MEDIA_POSITIONS] = media
        return extra
