"""Speech through the real stack: /v1/audio/speech (quality gate with pocketsphinx), chat with audio output
(transcript = text reply; the first audio arrives while the LLM is still writing), and the omni_speech
ensemble on Triton directly."""

import base64
import io

import numpy as np
import pytest
from asr import transcribe, word_recall
from helpers.chat_client import chat_messages, make_inputs, stream_infer
from helpers.http_calls import MODEL, post, post_json, sse_timed

from omni_backend.stages import tts_audio

pytestmark = pytest.mark.server

GATE_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call me when you get home tonight.",
    "The weather is nice and warm today.",
    "I would like a cup of coffee with milk.",
    "We are going to the park after school.",
]
STORY_PROMPT = "Tell me a short story about a cat."


@pytest.mark.parametrize("sentence", GATE_SENTENCES)
def test_speech_quality_gate(front_door, sentence, record_property):
    # VITS samples its noise, so each synthesis differs: the gate is the median word recall over 3, a typical
    # synthesis (clean-clone runs heard one outlier of three: "the court around fox chunks over the lazy dog", 0.67,
    # and "the corporate box to onto over the lazy dog", 0.56, beside 0.89 twice: a mean of 0.78 failed a gate that
    # broken audio, every synthesis low, still fails)
    heard, recalls = [], []
    for _ in range(3):
        status, headers, data = post(front_door.url + "/v1/audio/speech",
                                     {"model": "tts-1", "input": sentence, "voice": "alloy", "response_format": "wav"})
        assert status == 200, data
        assert headers["content-type"] == "audio/wav"
        samples, rate = tts_audio.decode_wav(data)
        assert rate == 22050 and samples.size > rate  # more than a second of speech
        heard.append(transcribe(samples, rate))
        recalls.append(word_recall(sentence, heard[-1]))
    recall = sorted(recalls)[1]
    record_property("transcripts", heard)
    record_property("word_recall", recall)
    print(f"median recall {recall:.2f}: {sentence!r} -> {heard!r}")
    assert recall >= 0.8, heard


def test_speech_formats_and_speed(front_door):
    body = {"model": MODEL, "input": "Hello there. How are you today?", "voice": "joe"}
    status, headers, pcm = post(front_door.url + "/v1/audio/speech", dict(body, response_format="pcm"))
    assert status == 200 and headers["content-type"] == "audio/pcm" and headers["x-sample-rate"] == "24000"
    seconds = len(pcm) / 2 / 24000
    assert 1.0 < seconds < 6.0
    import soundfile

    status, headers, flac = post(front_door.url + "/v1/audio/speech", dict(body, response_format="flac"))
    assert status == 200 and headers["content-type"] == "audio/flac"
    samples, rate = soundfile.read(io.BytesIO(flac), dtype="int16")
    assert rate == 22050 and abs(samples.size / rate - seconds) < 0.5
    status, _, fast = post(front_door.url + "/v1/audio/speech", dict(body, response_format="pcm", speed=2.0))
    assert status == 200 and len(fast) < 0.7 * len(pcm)
    if "mp3" in tts_audio.formats():
        status, headers, mp3 = post(front_door.url + "/v1/audio/speech", dict(body, response_format="mp3"))
        assert status == 200 and headers["content-type"] == "audio/mpeg" and len(mp3) > 1000
    status, error = post_json(front_door.url + "/v1/audio/speech", dict(body, response_format="opus"))
    assert status == 400 and error["error"]["param"] == "response_format" and "opus" in error["error"]["message"]


def chat_body(**extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": STORY_PROMPT}], "max_tokens": 80,
            "temperature": 0, **extra}


def test_chat_audio_transcript_equals_the_text_reply(front_door):
    status, text_reply = post_json(front_door.url + "/v1/chat/completions", chat_body())
    assert status == 200, text_reply
    status, reply = post_json(front_door.url + "/v1/chat/completions",
                              chat_body(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}))
    assert status == 200, reply
    message = reply["choices"][0]["message"]
    expected = text_reply["choices"][0]["message"]["content"]
    assert message["audio"]["transcript"] == expected
    assert message["content"] is None and message["audio"]["id"].startswith("audio")
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [reply["usage"][n] for n in counts] == [text_reply["usage"][n] for n in counts]
    # the same prompt just ran: its full KV blocks short of the last token come from the prefix cache
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == (reply["usage"]["prompt_tokens"] - 1) // 16 * 16
    samples, rate = tts_audio.decode_wav(base64.b64decode(message["audio"]["data"]))
    assert samples.size / rate > 3.0
    heard = transcribe(samples, rate)
    print(f"reply: {expected!r}\nheard: {heard!r}\nrecall {word_recall(expected, heard):.2f}")
    assert word_recall(expected, heard) >= 0.4  # made-up names (Luna, Elara) are not in the ASR vocabulary


def test_streamed_chat_audio_starts_before_the_llm_finishes(front_door, record_property):
    events = sse_timed(front_door.url + "/v1/chat/completions",
                       chat_body(stream=True, modalities=["text", "audio"], audio={"voice": "alloy", "format": "pcm16"},
                                 stream_options={"include_usage": True}))
    assert events[-1][1] == "[DONE]"
    chunks = [(t, e) for t, e in events[:-1] if e["choices"]]
    audio_times = [t for t, e in chunks if "data" in (e["choices"][0]["delta"].get("audio") or {})]
    transcript_times = [t for t, e in chunks if "transcript" in (e["choices"][0]["delta"].get("audio") or {})]
    transcript = "".join(e["choices"][0]["delta"]["audio"]["transcript"] for t, e in chunks
                         if "transcript" in (e["choices"][0]["delta"].get("audio") or {}))
    pcm = b"".join(base64.b64decode(e["choices"][0]["delta"]["audio"]["data"]) for t, e in chunks
                   if "data" in (e["choices"][0]["delta"].get("audio") or {}))
    first_audio, llm_done = audio_times[0], transcript_times[-1]
    record_property("first_audio_s", round(first_audio, 3))
    record_property("llm_finished_s", round(llm_done, 3))
    print(f"first audio chunk at {first_audio:.3f} s; last text delta (LLM finished) at {llm_done:.3f} s; "
          f"{len(audio_times)} audio chunks, {len(pcm) / 2 / 24000:.1f} s of audio")
    assert first_audio < llm_done
    assert len(audio_times) >= 2
    assert chunks[-1][1]["choices"][0]["finish_reason"] == "length" or chunks[-1][1]["choices"][0]["finish_reason"]
    usage = [e for t, e in events[:-1] if not e["choices"]][0]["usage"]
    assert usage["completion_tokens"] > 0
    status, text_reply = post_json(front_door.url + "/v1/chat/completions", chat_body())
    assert transcript == text_reply["choices"][0]["message"]["content"]


def test_omni_speech_ensemble_streams_numbered_phrases(triton_server, record_property):
    values = {"text_input": chat_messages(STORY_PROMPT), "max_tokens": 80, "temperature": 0.0, "stream": True}
    text = stream_infer(triton_server.grpc_url, values).text
    result = stream_speech(triton_server.grpc_url, dict(values, voice="alloy"))
    assert result["error"] is None, result["error"]
    responses = result["responses"]
    assert len(responses) >= 3
    assert sorted(r["chunk_index"] for r in responses) == list(range(len(responses)))
    ordered = sorted(responses, key=lambda r: r["chunk_index"])
    assert "".join(r["text"] for r in ordered) == text
    assert all(r["audio"].size > 0 for r in ordered if r["text"].strip())
    assert ordered[0]["completion_tokens"] < ordered[-1]["completion_tokens"]  # spoken while the LLM went on
    assert ordered[-1]["finish_reason"] in ("stop", "length") and ordered[0]["sample_rate"] == 22050
    record_property("ensemble_first_audio_s", round(ordered[0]["time"], 3))
    record_property("ensemble_last_chunk_s", round(ordered[-1]["time"], 3))
    print(f"omni_speech: first phrase at {ordered[0]['time']:.3f} s after {ordered[0]['completion_tokens']} tokens, "
          f"last at {ordered[-1]['time']:.3f} s after {ordered[-1]['completion_tokens']} tokens")


def test_omni_speech_rejects_bad_speech_options_before_generating(triton_server):
    values = {"text_input": chat_messages("Hi"), "max_tokens": 8, "stream": True}
    for voice, fragment in [("", "voice must not be empty"), ("nobody", "voice 'nobody' is not available")]:
        result = stream_speech(triton_server.grpc_url, dict(values, voice=voice))
        assert result["error"] and fragment in result["error"]
    result = stream_speech(triton_server.grpc_url, dict(values, voice="joe", speed=9.0))
    assert "speed must be between" in result["error"]
    assert stream_speech(triton_server.grpc_url, dict(values, voice="joe"))["error"] is None


def stream_speech(grpc_url: str, values: dict) -> dict:
    """One omni_speech request over a gRPC stream: responses (text, audio, index, counts, arrival time)."""
    import queue
    import time

    import tritonclient.grpc as grpcclient

    speech = {k: values.pop(k) for k in ("voice", "speed") if k in values}
    inputs = make_inputs(values, grpcclient)
    for name, value in speech.items():
        array = np.array([value.encode()], dtype=object) if name == "voice" else np.array([value], np.float32)
        tensor = grpcclient.InferInput(name, [1], "BYTES" if name == "voice" else "FP32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    events = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    out = {"responses": [], "error": None}
    try:
        client.start_stream(callback=lambda result, error: events.put((time.monotonic(), result, error)))
        started = time.monotonic()
        client.async_stream_infer("omni_speech", inputs, enable_empty_final_response=True)
        while True:
            at, response, error = events.get(timeout=180)
            if error is not None:
                out["error"] = error.message() if hasattr(error, "message") else str(error)
                return out
            message = response.get_response()
            if message.outputs:
                out["responses"].append({
                    "text": response.as_numpy("text_output")[0].decode(), "audio": response.as_numpy("audio"),
                    "chunk_index": int(response.as_numpy("chunk_index")[0]),
                    "completion_tokens": int(response.as_numpy("completion_tokens")[0]),
                    "finish_reason": response.as_numpy("finish_reason")[0].decode(),
                    "sample_rate": int(response.as_numpy("sample_rate")[0]), "time": at - started})
            if message.parameters["triton_final_response"].bool_param:
                return out
    finally:
        client.stop_stream()
        client.close()
