"""A chat answer spoken as well as written (`"modalities": ["text", "audio"]`): the chat pipeline runs as for text,
the streamed text is cut into phrases by the tts stage's `SentenceChunker` (stages/tts_text.py), and `tts` speaks
each phrase as soon as it is complete, while the LLM goes on. serving/responses.py shapes the answer as a written
one, with OpenAI's audio pieces from here: `message.audio` (id, base64 data, expires_at, transcript = the text),
or streamed `delta.audio.transcript` per text delta, `delta.audio.data` per phrase (pcm16 only, as with OpenAI)
and `delta.audio.expires_at` with the finish reason.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import replace
from typing import AsyncIterator

from omni_backend.serving import errors, protocol
from omni_backend.serving.generation import Choice, ChoiceResult, Generation
from omni_backend.serving.pipeline import Step
from omni_backend.serving.speech_backend import Audio, SpeechBackend
from omni_backend.stages import tts_audio
from omni_backend.stages.tts_input import speech_text, unspeakable_reason
from omni_backend.stages.tts_options import SpeechOptions
from omni_backend.stages.tts_text import SentenceChunker

AUDIO_EXPIRY_S = 3600
SILENT_RATE = 22050  # the sample rate of an answer with nothing to speak (the default voice's)


class SpokenAnswer:
    """The spoken side of one chat answer (one choice: protocol.py refuses n > 1 with audio).

    Args:
        backend: the tts stage.
        options: the voice and audio format (`GenerationRequest.speech`).
    """

    def __init__(self, backend: SpeechBackend, options: SpeechOptions):
        self.backend, self.options = backend, options
        self.id = protocol.new_id("audio")

    async def merged(self, generation: Generation) -> AsyncIterator[tuple[Choice, Step | Audio]]:
        """The generation's steps, and the Audio of each phrase, in phrase order, as soon as it is spoken.

        The last step comes twice: its text as it arrives, its finish reason after the last phrase's audio (the
        answer ends when all of it is spoken). A phrase with nothing to speak (only punctuation or symbols) is
        part of the transcript but gets no audio. Closing this stops the LLM and the speaking.

        Raises:
            OpenAIError: from the pipeline or the tts stage.
        """
        choice = generation.choices[0]
        inbox: asyncio.Queue[Step | Exception | None] = asyncio.Queue()  # None: a phrase's audio is done
        chunker = SentenceChunker()
        spoken: list[asyncio.Task] = []

        def speak(phrases: list[str]) -> None:
            for phrase in map(speech_text, phrases):
                if unspeakable_reason(phrase) is None:
                    spoken.append(asyncio.ensure_future(self.backend.speak(phrase, self.options, "messages")))
                    spoken[-1].add_done_callback(lambda _: inbox.put_nowait(None))

        async def listen() -> None:
            try:
                async for _, step in generation.merged():
                    speak(chunker.push(step.text))
                    if step.finish_reason:
                        speak(chunker.flush())
                    inbox.put_nowait(step)
                    if step.finish_reason:
                        return
                inbox.put_nowait(errors.internal("the chat stream ended before its final response"))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer
                inbox.put_nowait(exc)

        listener = asyncio.ensure_future(listen())
        sent, final = 0, None
        try:
            while final is None or sent < len(spoken):
                item = await inbox.get()
                if isinstance(item, Exception):
                    raise item
                if item is not None:
                    if item.finish_reason:
                        final, item = item, replace(item, finish_reason=None)
                    yield choice, item
                while sent < len(spoken) and spoken[sent].done():
                    sent += 1
                    yield choice, spoken[sent - 1].result()
            yield choice, replace(final, text="", logprobs=None)
        finally:
            listener.cancel()
            for task in spoken:
                task.cancel()
            await asyncio.gather(listener, *spoken, return_exceptions=True)
            await generation.close()

    def message(self, result: ChoiceResult) -> dict:
        """The assistant message of a whole answer: `audio` in the requested format, the text as its transcript."""
        audio = Audio.joined(result.audio, SILENT_RATE)
        data = tts_audio.encode(audio.samples, audio.rate, self.options.audio_format)
        return {"role": "assistant", "content": None, "refusal": None,
                "audio": {"id": self.id, "data": base64.b64encode(data).decode("ascii"),
                          "expires_at": protocol.now() + AUDIO_EXPIRY_S, "transcript": result.text}}

    def text_delta(self, text: str) -> dict:
        return {"audio": {"id": self.id, "transcript": text}}

    def audio_delta(self, audio: Audio) -> dict:
        """A phrase's audio as OpenAI streams it: base64 pcm16 (24 kHz)."""
        data = tts_audio.pcm_bytes(audio.samples, audio.rate)
        return {"audio": {"id": self.id, "data": base64.b64encode(data).decode("ascii")}}

    def finish_delta(self) -> dict:
        return {"audio": {"id": self.id, "expires_at": protocol.now() + AUDIO_EXPIRY_S}}
