"""A chat answer spoken too, without a server: the request's audio fields, and the answer built by the text
answer's builders (serving/responses.py) from a scripted LLM stream and a fake tts stage."""

import asyncio
import base64
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

from omni_backend.serving import errors, protocol
from omni_backend.serving.generation import collect
from omni_backend.serving.pipeline import Step
from omni_backend.serving.responses import completion_object, stream_events
from omni_backend.serving.speech_backend import Audio
from omni_backend.serving.spoken import SpokenAnswer
from omni_backend.stages import tts_audio
from omni_backend.stages.tts_options import SpeechOptions

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SPEAK = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}
REPLY = "Once upon a time, there was a cat. ... It purred."
PHRASES = ["Once upon a time, ", "there was a cat. ", "It purred."]  # "... " has nothing to speak
RATE = tts_audio.PCM_RATE  # the fake voice's rate: pcm16 deltas are its samples unchanged


def test_a_spoken_answer_is_asked_with_modalities_or_audio():
    request = protocol.parse_request(protocol.ChatCompletionRequest, {**CHAT, **SPEAK})
    generation = request.generation()
    assert generation.speech == SpeechOptions(voice="joe", audio_format="wav")
    assert not generation.stream and generation.choice_settings(0)["stream"]  # the llm streams all the same
    for extra in ({"audio": {"voice": {"id": "joe"}, "format": "pcm16"}},
                  {"modalities": [], "audio": {"voice": "joe", "format": "pcm16"}}):
        assert protocol.parse_request(protocol.ChatCompletionRequest, {**CHAT, **extra}).generation().speech == \
            SpeechOptions(voice="joe", audio_format="pcm")
    written = protocol.parse_request(protocol.ChatCompletionRequest, {**CHAT, "modalities": ["text"]}).generation()
    assert written.speech is None and written.choice_settings(0)["stream"] is False


@pytest.mark.parametrize("extra, param, fragment", [
    ({"modalities": ["video", "audio"]}, "modalities", 'modalities must be ["text", "audio"]'),
    ({"modalities": ["text"]}, "modalities", 'modalities must be ["text", "audio"]'),
    ({"modalities": ["video"], "audio": None}, "modalities", 'modalities: ["text"], or'),
    ({"modalities": False}, "modalities", "valid list"),
    ({"audio": None}, "audio", "'audio' ({\"voice\", \"format\"}) is required"),
    ({"audio": "alloy"}, "audio", "valid dictionary"),
    ({"audio": {"format": "wav"}}, "audio.voice", "'audio.voice' is a required property"),
    ({"audio": {"voice": "", "format": "wav"}}, "audio.voice", "audio.voice must not be empty"),
    ({"audio": {"voice": "nobody", "format": "wav"}}, "audio.voice", "audio.voice 'nobody' is not available"),
    ({"audio": {"voice": {"id": 5}, "format": "wav"}}, "audio.voice", "'audio.voice' is a required property"),
    ({"audio": {"voice": "joe", "format": "ogg"}}, "audio.format", "audio.format 'ogg' is not supported; "
                                                                   "supported: wav, "),
    ({"audio": {"voice": "joe", "format": "pcm"}}, "audio.format", "audio.format 'pcm' is not supported"),
    ({"n": 2}, "n", "n must be 1 when audio output is requested"),
    ({"stream": True}, "audio.format", "streamed audio output needs audio.format 'pcm16'"),
    ({"logprobs": True}, "logprobs", "logprobs are not available with audio output"),
])
def test_audio_fields_are_checked_with_the_request(extra, param, fragment):
    with pytest.raises(errors.OpenAIError) as excinfo:
        protocol.parse_request(protocol.ChatCompletionRequest, {**CHAT, **SPEAK, **extra})
    assert (excinfo.value.status, excinfo.value.param) == (400, param)
    assert fragment in excinfo.value.message, excinfo.value.message


class ScriptedGeneration:
    """A Generation whose one choice streams `REPLY` word by word, `delay_s` apart."""

    def __init__(self, delay_s: float):
        self.delay_s, self.closed = delay_s, False
        self.choices = [SimpleNamespace(index=0, prepared=SimpleNamespace(prompt_tokens=7, prompt_text=""))]

    async def merged(self):
        deltas = re.findall(r"\s*\S+|\s+", REPLY)
        for count, delta in enumerate(deltas, 1):
            await asyncio.sleep(self.delay_s)
            yield self.choices[0], Step(delta, "stop" if count == len(deltas) else None, 7, count, None,
                                        cached_tokens=3)

    async def close(self):
        self.closed = True


class FakeTTS:
    """Speaks one sample (its character's code) per character of the phrase."""

    def __init__(self):
        self.spoken = []

    async def speak(self, text, options, field):
        self.spoken.append(text)
        await asyncio.sleep(0)
        return Audio(np.frombuffer(text.encode("ascii"), np.uint8).astype(np.int16), RATE)


def spoken_request(**extra):
    return protocol.parse_request(protocol.ChatCompletionRequest, {**CHAT, **SPEAK, **extra}).generation()


def test_the_streamed_spoken_answer_speaks_while_the_llm_writes():
    request = spoken_request(stream=True, stream_options={"include_usage": True},
                             audio={"voice": "alloy", "format": "pcm16"})
    generation, tts = ScriptedGeneration(delay_s=0.01), FakeTTS()
    spoken = SpokenAnswer(tts, request.speech)

    async def run():
        return [event.data async for event in stream_events(request, generation, "chatcmpl-1", spoken)]

    events = asyncio.run(run())
    assert events[-1] == "[DONE]" and generation.closed and tts.spoken == PHRASES
    chunks = [json.loads(event) for event in events[:-1]]
    assert {c["id"] for c in chunks} == {"chatcmpl-1"} and {c["object"] for c in chunks} == {"chat.completion.chunk"}
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0] == {"role": "assistant", "content": None}
    audio = [d["audio"] for d in deltas[1:]]
    assert {a["id"] for a in audio} == {spoken.id}
    assert "".join(a.get("transcript", "") for a in audio) == REPLY
    data = [base64.b64decode(a["data"]) for a in audio if "data" in a]
    assert [np.frombuffer(d, "<i2").astype(np.uint8).tobytes().decode() for d in data] == PHRASES
    first_audio = next(i for i, a in enumerate(audio) if "data" in a)
    last_text = max(i for i, a in enumerate(audio) if "transcript" in a)
    assert first_audio < last_text  # the first phrase is heard while the LLM still writes
    assert set(audio[-1]) == {"id", "expires_at"} and chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-2]] == [None] * (len(chunks) - 2)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == protocol.usage(7, 11, 3)


def test_the_whole_spoken_answer_is_one_message():
    request = spoken_request()
    generation, tts = ScriptedGeneration(delay_s=0), FakeTTS()
    spoken = SpokenAnswer(tts, request.speech)

    async def run():
        return await collect(generation, spoken.merged(generation))

    answer = completion_object(request, generation, asyncio.run(run()), "chatcmpl-2", spoken)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    message = choice["message"]
    assert message["content"] is None and message["audio"]["transcript"] == REPLY
    samples, rate = tts_audio.decode_wav(base64.b64decode(message["audio"]["data"]))
    assert rate == RATE and samples.astype(np.uint8).tobytes().decode() == "".join(PHRASES)
    assert answer["usage"] == protocol.usage(7, 11, 3)
