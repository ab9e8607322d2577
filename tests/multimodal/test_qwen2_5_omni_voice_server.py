"""The tiny Qwen2.5-Omni speaking with its own voice through the real tritonserver (issue 27): `omni_speech` runs
preprocess -> media_embed (a prompt with image or audio parts) -> llm (with the thinker's rows) -> voice (talker +
code2wav) when the served checkpoint has a talker, and the front door drives the same stages itself.
The talker is greedy here (its test-only setting) and its answers short, so the waveform's length is known from its
codec tokens; the tiny vocoder's samples peak near 5e-7, so the float waveform is checked, not 16-bit silence.
A spoken answer's text is checked against the written answer to the same greedy request (omni_chat_mm's, or the
front door's without audio)."""

from __future__ import annotations

import base64
import io
import json
import re
import time
import urllib.request
import wave
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from helpers.chat_client import make_inputs, stream_infer, stream_inputs
from helpers.front_door import FrontDoorThread, front_door_config
from helpers.llm_metrics import wait_for
from helpers.triton_server import start_tritonserver
from omni_reference import content

from omni_backend import repository
from omni_backend.setup.tiny_hf_multimodal import build

pytestmark = pytest.mark.server

MODELS = ["preprocess", "llm", "postprocess", "omni_chat", "speech_options", "tts", "voice", "omni_speech",
          "vision_encoder", "audio_encoder", "media_embed", "omni_chat_mm"]
MEDIA_CASES = ("image", "audio")  # omni_reference's astronaut photo and Piper's spoken question
CODEC_TOKENS = 13  # a DiT block of 12 codec frames in the tiny model, and one more
SAMPLES_PER_CODE = 2 * 240  # mel frames per codec frame x the vocoder's hop


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(checkpoint folder, tritonserver, front door URL) of the tiny Qwen2.5-Omni with its voice stage."""
    root = tmp_path_factory.mktemp("omni-voice-server")
    folder = str(build("qwen2_5_omni", root / "checkpoint", log=lambda _: None))
    repository.render_repository(root / "model_repository", models=MODELS, dtype="float32", llm_model_path=folder,
                                 kv_cache_bytes=16 * 1024 * 1024, max_num_seqs=4, max_model_len=1024,
                                 talker_kv_cache_bytes=4 * 1024 * 1024, talker_max_codec_tokens=CODEC_TOKENS,
                                 code2wav_num_steps=2, code2wav_vocoder_context=0, code2wav_future_blocks=0,
                                 code2wav_chunk_blocks=1, code2wav_max_delay_steps=16)
    config = root / "model_repository" / "voice" / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "talker_greedy" value: { string_value: "true" } }\n')
    server = start_tritonserver(root)
    door = FrontDoorThread(front_door_config(server)).start()
    yield folder, server, door.url
    door.stop()
    server.stop()


def prompt_values(text_input: str = "Say hello.", max_tokens: int = 3) -> dict:
    """A greedy request's omni_chat/omni_chat_mm/omni_speech inputs (text_input: plain text or chat messages as
    JSON)."""
    return {"text_input": text_input, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def speech_inputs(voice: str, max_tokens: int = 3, text_input: str = "Say hello.") -> list:
    inputs = make_inputs(prompt_values(text_input, max_tokens), grpcclient)
    tensor = grpcclient.InferInput("voice", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([voice.encode()], dtype=np.object_))
    return inputs + [tensor]


def spoken_text(result) -> str:
    """The text of an omni_speech answer: its responses that carry no audio, checked to be a whole answer in the
    model's own voice (chunks in order, 24 kHz, a whole number of codec frames, finite, not silent, the 16-bit
    audio the float waveform's samples), ended by a response without audio carrying the finish reason."""
    assert result.error is None
    audio = [r for r in result.responses if "waveform" in r]
    assert audio and [int(r["chunk_index"][0]) for r in audio] == list(range(len(audio)))
    assert all(int(r["sample_rate"][0]) == 24000 for r in audio)
    waveform = np.concatenate([r["waveform"] for r in audio])
    assert waveform.size % SAMPLES_PER_CODE == 0 and 0 < waveform.size <= CODEC_TOKENS * SAMPLES_PER_CODE
    assert np.abs(waveform).max() > 0 and np.isfinite(waveform).all()
    assert np.array_equal(np.concatenate([r["audio"] for r in audio]), np.rint(waveform * 32767).astype(np.int16))
    assert "waveform" not in result.responses[-1]
    return "".join(r["text_output"][0].decode() for r in result.responses if "waveform" not in r)


def test_omni_speech_streams_text_and_the_models_own_voice(served):
    _, server, _ = served
    result = stream_inputs(server.grpc_url, speech_inputs("Ethan"), "omni_speech", timeout_s=300)
    assert spoken_text(result) == stream_infer(server.grpc_url, prompt_values(), "omni_chat", timeout_s=300).text
    assert result.last("finish_reason") == "length" and result.last("completion_tokens") == 3


@pytest.mark.parametrize("case", MEDIA_CASES)
def test_omni_speech_answers_an_image_or_audio_prompt_in_the_models_own_voice(served, case):
    """The prompt's media go through media_embed, the thinker's rows of its placeholder positions to the talker: a
    whole spoken answer whose text is omni_chat_mm's greedy answer to the same request, with its prompt's tokens."""
    _, server, _ = served
    chat = json.dumps([{"role": "user", "content": content(case)}])
    written = stream_infer(server.grpc_url, prompt_values(chat), "omni_chat_mm", timeout_s=300)
    assert written.error is None and written.text
    result = stream_inputs(server.grpc_url, speech_inputs("Ethan", text_input=chat), "omni_speech", timeout_s=300)
    assert spoken_text(result) == written.text
    assert result.last("prompt_tokens") == written.last("prompt_tokens") > 20  # the media's placeholders counted
    assert result.last("finish_reason") == "length" and result.last("completion_tokens") == 3


def test_an_unknown_voice_is_refused_naming_the_voices_and_the_next_request_works(served):
    _, server, _ = served
    refused = stream_inputs(server.grpc_url, speech_inputs("Nobody"), "omni_speech", timeout_s=300)
    assert "voice 'Nobody' is not a voice of this model; its voices: Chelsie, Ethan" in refused.error
    again = stream_inputs(server.grpc_url, speech_inputs("Chelsie", 2), "omni_speech", timeout_s=300)
    assert again.error is None and any("waveform" in r for r in again.responses)


def chat(url, voice="Chelsie", stream=False, audio_format="wav", max_tokens=3, timeout=300, message="Say hello.",
         **extra):
    """A greedy chat answer spoken in `voice` (None: written only); `message`: the user message's content."""
    body = {"model": "omni_chat", "messages": [{"role": "user", "content": message}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream, **extra}
    if voice is not None:
        body.update(modalities=["text", "audio"], audio={"voice": voice, "format": audio_format})
    return requests.post(f"{url}/v1/chat/completions", json=body, timeout=timeout, stream=stream)


def events(response) -> list[dict]:
    lines = [line for line in response.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@pytest.mark.parametrize("case", ("text", *MEDIA_CASES))
def test_the_front_door_speaks_in_the_models_own_voice_whole_and_streamed(served, case):
    """A text, image or audio prompt. Non-streamed: message.audio is a 24 kHz WAV of a whole number of codec frames,
    its transcript the written answer to the same greedy request; streamed: the same text as transcript deltas,
    pcm16 audio deltas as long as the WAV (greedy talker: the same codes), then the finish reason. (The tiny
    vocoder's samples round to 16-bit silence; their float values are checked through Triton above.)"""
    _, _, url = served
    message = "Say hello." if case == "text" else content(case)
    written = chat(url, voice=None, message=message)
    assert written.status_code == 200, written.text
    text = written.json()["choices"][0]["message"]["content"]
    assert text
    whole = chat(url, message=message)
    assert whole.status_code == 200, whole.text
    answer = whole.json()["choices"][0]
    audio = answer["message"]["audio"]
    with wave.open(io.BytesIO(base64.b64decode(audio["data"]))) as clip:
        rate, frames = clip.getframerate(), clip.getnframes()
    assert rate == 24000 and frames % SAMPLES_PER_CODE == 0 and 0 < frames <= CODEC_TOKENS * SAMPLES_PER_CODE
    assert audio["transcript"] == text and answer["finish_reason"] == "length"
    assert answer["message"]["content"] is None
    assert whole.json()["usage"]["prompt_tokens"] == written.json()["usage"]["prompt_tokens"]
    streamed = chat(url, stream=True, audio_format="pcm16", message=message)
    assert streamed.status_code == 200
    chunks = events(streamed)
    deltas = [c["choices"][0]["delta"].get("audio", {}) for c in chunks if c["choices"]]
    assert "".join(d.get("transcript", "") for d in deltas) == text
    pcm = b"".join(base64.b64decode(d["data"]) for d in deltas if "data" in d)
    assert len(pcm) == 2 * frames
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "expires_at" in deltas[-1]


def test_an_unknown_voice_is_a_400_naming_the_models_voices(served):
    _, _, url = served
    refused = chat(url, voice="alloy")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "audio.voice" and "its voices: Chelsie, Ethan" in error["message"]
    assert chat(url, voice="ethan").status_code == 200  # any case


def voice_metrics(server) -> dict[str, float]:
    """The voice stage's metrics: gauges and counters by name, histograms as <name>_count and <name>_le1 (the
    observations of 1); and the llm stage's as llm_<name>: tokens generated, engine steps (both modes) and the
    sequences in them."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    values = {}
    for name in ("omni_talker_kv_cache_blocks_used", "omni_voice_answers", "omni_voice_cancelled_total",
                 "omni_talker_batch_size_count", "omni_code2wav_batch_size_count",
                 "omni_voice_time_to_first_audio_seconds_count"):
        match = re.search(rf'^{name}{{[^}}]*model="voice"[^}}]*}} (\S+)$', text, re.MULTILINE)
        values[name] = float(match.group(1)) if match else 0.0
    for name in ("omni_talker_batch_size", "omni_code2wav_batch_size"):
        match = re.search(rf'^{name}_bucket{{[^}}]*le="1(?:\.0)?"[^}}]*}} (\S+)$', text, re.MULTILINE)
        values[f"{name}_le1"] = float(match.group(1)) if match else 0.0
    for name in ("omni_generation_tokens_total", "omni_engine_steps_total", "omni_engine_step_sequences_total"):
        found = re.findall(rf'^{name}{{[^}}]*model="llm"[^}}]*}} (\S+)$', text, re.MULTILINE)
        values[f"llm_{name}"] = sum(map(float, found))
    return values


def settled(server) -> dict[str, float]:
    """The voice metrics once two reads 0.3 s apart agree (the stage publishes a finished answer's last snapshot
    a moment after its last chunk went out)."""
    def same():
        first = voice_metrics(server)
        time.sleep(0.3)
        return first == voice_metrics(server) and first

    values = wait_for(same, 10, 0)
    assert values, "the voice metrics do not settle"
    return values


def test_four_concurrent_answers_are_batched_in_the_thinker_talker_and_code2wav(served):
    """Four answers at once: each is whole, its transcript the written answer to the same greedy request (asked
    before, one at a time), and the metrics show thinker (llm) steps, talker steps and code2wav calls that served
    more than one answer, a first audio per answer, and the talker's KV blocks free after. Text prompts, so that the
    four start together (media ones wait for their encoders first, and a chunk waits for others to batch with
    for at most code2wav_max_delay_steps talker steps)."""
    _, server, url = served
    messages = ["Say hello.", "Name a colour.", "Say hello.", "Name a colour."]
    tokens = 12  # thinker tokens per answer: long enough for the four to overlap in its steps
    written = [chat(url, voice=None, message=m, max_tokens=tokens).json()["choices"][0]["message"]["content"]
               for m in messages]
    assert all(written)
    before = settled(server)
    with ThreadPoolExecutor(len(messages)) as pool:
        answers = list(pool.map(lambda m: chat(url, audio_format="pcm16", message=m, max_tokens=tokens), messages))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    audio = [a.json()["choices"][0]["message"]["audio"] for a in answers]
    assert [a["transcript"] for a in audio] == written
    for clip in audio:
        size = len(base64.b64decode(clip["data"]))
        assert size % (2 * SAMPLES_PER_CODE) == 0 and 0 < size <= 2 * CODEC_TOKENS * SAMPLES_PER_CODE
    # the llm stage publishes once a second: wait for the answers' tokens (its steps come in the same snapshot)
    published = wait_for(lambda: (m := voice_metrics(server))["llm_omni_generation_tokens_total"] - before[
        "llm_omni_generation_tokens_total"] >= len(messages) * tokens and m, 10)
    assert published, "the llm stage did not publish the answers' tokens"
    after = settled(server)
    steps = after["llm_omni_engine_steps_total"] - before["llm_omni_engine_steps_total"]
    assert after["llm_omni_engine_step_sequences_total"] - before["llm_omni_engine_step_sequences_total"] > steps, \
        f"no thinker step above 1: {after}"
    for name in ("omni_talker_batch_size", "omni_code2wav_batch_size"):
        calls = after[f"{name}_count"] - before[f"{name}_count"]
        alone = after[f"{name}_le1"] - before[f"{name}_le1"]
        assert calls > alone, f"no {name} above 1: {after}"
    assert after["omni_voice_time_to_first_audio_seconds_count"] - before[
        "omni_voice_time_to_first_audio_seconds_count"] == len(messages)
    assert after["omni_talker_kv_cache_blocks_used"] == 0


def test_a_client_that_goes_away_ends_its_answer_in_the_voice_stage(served):
    """The client leaves at its first audio delta, while the thinker still writes its 900 tokens (the voice stage
    holds an answer until its last rows): the front door cancels it there, the talker's KV blocks are freed."""
    _, server, url = served
    before = settled(server)["omni_voice_cancelled_total"]
    response = chat(url, stream=True, audio_format="pcm16", max_tokens=900)
    assert response.status_code == 200
    next(line for line in response.iter_lines() if b'"data": "' in line)
    response.close()
    idle = wait_for(lambda: (m := voice_metrics(server))["omni_voice_cancelled_total"] == before + 1
                    and m["omni_voice_answers"] == 0 and m, 10)
    assert idle and idle["omni_talker_kv_cache_blocks_used"] == 0, voice_metrics(server)
    assert chat(url).status_code == 200
