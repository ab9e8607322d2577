"""The speech stage's pieces without a server: phrase chunking, options, the stream state, audio containers."""

import io
import re
import wave

import numpy as np
import pytest

from omni_backend.stages import tts_audio
from omni_backend.stages.tts import SpeechSettings, SpeechStage
from omni_backend.stages.tts_options import SpeechOptions, check_speed, resolve_voice
from omni_backend.stages.tts_text import SentenceChunker

STORY = ("Once upon a time, there was a cat named Dr. Whiskers. He lived in a house with 3.5 rooms! "
         "Did he like it? Yes.\nThe end")


def token_deltas(text: str) -> list[str]:
    return re.findall(r"\s*\S+|\s+", text)


def test_chunks_join_back_to_the_text_with_an_early_first_chunk():
    chunker = SentenceChunker()
    chunks = []
    for delta in token_deltas(STORY):
        chunks += chunker.push(delta)
    chunks += chunker.flush()
    assert "".join(chunks) == STORY
    assert chunks == ["Once upon a time, ", "there was a cat named Dr. Whiskers. ",
                      "He lived in a house with 3.5 rooms! ", "Did he like it? ", "Yes.\n", "The end"]


def test_first_chunk_without_punctuation_ends_after_a_few_words():
    chunker = SentenceChunker(first_max_words=6)
    assert chunker.push("This is a long first sentence without any punctuation at all") == \
        ["This is a long first sentence "]
    assert chunker.push(" and more") == []  # later chunks wait for a sentence end
    assert chunker.flush() == ["without any punctuation at all and more"]


def test_a_dot_waits_for_the_next_character_and_long_text_is_cut():
    chunker = SentenceChunker(first_min_words=100, first_max_words=100, max_chars=40)
    assert chunker.push("It costs 3.") == []
    assert chunker.push("5 dollars. Next") == ["It costs 3.5 dollars. "]
    long = "word " * 20
    pieces = chunker.push(long)
    assert pieces and all(len(p) <= 45 for p in pieces)
    assert "".join(pieces) + chunker.flush()[0] == "Next" + long


def test_options_resolve_aliases_and_reject_bad_values():
    assert resolve_voice("alloy") == "joe" and resolve_voice("Joe") == "joe"
    for bad, fragment in [("", "voice must not be empty"), ("x", "voice 'x' is not available")]:
        with pytest.raises(ValueError, match=fragment):
            resolve_voice(bad)
    with pytest.raises(ValueError, match="speed must be between"):
        check_speed(5)
    with pytest.raises(ValueError, match="audio_format 'ogg' is not supported"):
        SpeechOptions.create("joe", "ogg")
    options = SpeechOptions.create("nova", "wav", 1.5, stream=True)
    assert SpeechOptions.from_json(options.to_json()) == options and len(options.stream) == 32
    with pytest.raises(ValueError, match="unknown speech option"):
        SpeechOptions.from_json('{"colour": "red"}')


class FakeSynthesizer:
    """One sample per character, so audio length says which text was spoken."""

    sample_rate = 100
    voices = ("joe",)

    def __init__(self):
        self.spoken = []

    def stream(self, text, voice, speed=1.0):
        self.spoken.append(text)
        yield np.full(len(text), 7, dtype=np.int16)


def arrays(text, stream="", finish_reason=None, completion_tokens=0):
    values = {"text": np.array([text.encode()], dtype=object),
              "options": np.array([SpeechOptions(stream=stream).to_json().encode()], dtype=object),
              "completion_tokens": np.array([completion_tokens], dtype=np.int32)}
    if finish_reason is not None:
        values["finish_reason"] = np.array([finish_reason.encode()], dtype=object)
    return values


def test_stream_deltas_become_numbered_phrases_and_the_state_is_dropped_at_the_end():
    stage = SpeechStage(FakeSynthesizer())
    outputs = []
    deltas = token_deltas(STORY)
    for i, delta in enumerate(deltas):
        last = i == len(deltas) - 1
        outputs += list(stage.run(arrays(delta, "s1", "stop" if last else "", completion_tokens=i + 1)))
    texts = [o["text_output"][0].decode() for o in outputs]
    assert "".join(texts) == STORY
    assert [int(o["chunk_index"][0]) for o in outputs] == list(range(len(outputs)))
    assert [o["finish_reason"][0] for o in outputs] == [b""] * (len(outputs) - 1) + [b"stop"]
    assert all(o["audio"].size == len(t.strip()) or o["audio"].size == len(t) for o, t in zip(outputs, texts))
    assert int(outputs[0]["completion_tokens"][0]) < int(outputs[-1]["completion_tokens"][0])
    assert stage.open_streams == 0


def test_end_of_stream_with_nothing_left_still_answers_once():
    stage = SpeechStage(FakeSynthesizer())
    assert len(list(stage.run(arrays("Hello there. ", "s2")))) == 1
    (last,) = stage.run(arrays("", "s2", "length"))
    assert last["text_output"][0] == b"" and last["audio"].size == 0 and last["finish_reason"][0] == b"length"
    assert int(last["chunk_index"][0]) == 1


def test_self_contained_text_is_cut_at_sentences_and_checked():
    synthesizer = FakeSynthesizer()
    stage = SpeechStage(synthesizer, SpeechSettings(max_text_chars=80))
    outputs = list(stage.run(arrays("The quick brown fox jumps over the lazy dog. Then it sleeps.")))
    assert synthesizer.spoken == ["The quick brown fox jumps over the lazy dog. ", "Then it sleeps."]
    assert outputs[-1]["finish_reason"][0] == b"stop"
    with pytest.raises(ValueError, match="text must not be empty"):
        stage.run(arrays("   "))
    with pytest.raises(ValueError, match="the limit is 80"):
        stage.run(arrays("x" * 81))


def test_stale_streams_are_forgotten():
    stage = SpeechStage(FakeSynthesizer(), SpeechSettings(stream_ttl_s=1e-9))
    list(stage.run(arrays("An unfinished", "gone")))
    list(stage.run(arrays("Another one", "other")))
    assert stage.open_streams == 1


def test_audio_containers():
    tone = (np.sin(np.arange(22050) / 22050 * 2 * np.pi * 440) * 10000).astype(np.int16)
    data = tts_audio.encode(tone, 22050, "wav")
    with wave.open(io.BytesIO(data)) as clip:
        assert (clip.getframerate(), clip.getnframes()) == (22050, 22050)
    samples, rate = tts_audio.decode_wav(data)
    assert rate == 22050 and np.array_equal(samples, tone)
    pcm = tts_audio.encode(tone, 22050, "pcm")
    assert len(pcm) == 2 * tts_audio.PCM_RATE  # one second at 24 kHz
    assert "flac" in tts_audio.formats()
    import soundfile

    decoded, rate = soundfile.read(io.BytesIO(tts_audio.encode(tone, 22050, "flac")), dtype="int16")
    assert rate == 22050 and np.array_equal(decoded, tone)
    if "mp3" in tts_audio.formats():
        mp3 = tts_audio.encode(tone, 22050, "mp3")
        assert mp3[:3] == b"ID3" or mp3[0] == 0xFF  # ID3 tag or an MPEG frame sync


def test_worker_speaks_every_request_first_phrase_before_any_second_one():
    import threading

    class Sink:
        def __init__(self, name, log, done):
            self.name, self.log, self.done = name, log, done

        def send(self, outputs, final):
            self.log.append((self.name, int(outputs["chunk_index"][0]), final))
            if final:
                self.done.release()

        def fail(self, message):
            raise AssertionError(message)

        def is_cancelled(self):
            return False

    from omni_backend.stages.tts import SpeechWorker

    stage = SpeechStage(FakeSynthesizer())
    log, done = [], threading.Semaphore(0)
    worker = SpeechWorker(stage, start=False)  # queue both requests before the thread runs
    for name in ("a", "b"):
        options, chunks = stage.plan(arrays("One sentence here. Two sentences here. Three."))
        worker.submit(options, chunks, Sink(name, log, done))
    worker.start()
    assert done.acquire(timeout=10) and done.acquire(timeout=10)
    worker.shutdown()
    assert log == [("a", 0, False), ("b", 0, False), ("a", 1, False), ("b", 1, False), ("a", 2, True),
                   ("b", 2, True)]


@pytest.mark.parametrize("audio_format", ["wav", "flac", "mp3"])
def test_an_empty_clip_is_still_a_decodable_file(audio_format):
    """Input with nothing to speak gives no samples; libsndfile writes 0 bytes for that (the fuzzer found a 200
    with an empty "mp3" body)."""
    import soundfile

    if audio_format not in tts_audio.formats():
        pytest.skip(f"{audio_format} is not writable with this libsndfile")
    decoded, rate = soundfile.read(io.BytesIO(tts_audio.encode(np.zeros(0, np.int16), 22050, audio_format)),
                                   dtype="int16")
    assert rate == 22050 and decoded.size <= 1 and not decoded.any()
