"""The voice stage's requests (omni_backend/stages/voice.py) over a real OmniVoice on the tiny Qwen2.5-Omni: an
answer's chunks reach its requests as the module docstring says and equal OmniVoice driven directly; a cancel frees
the talker's KV; refused voices and rows end only their answer."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from omni_backend.setup.tiny_hf_multimodal import build
from omni_backend.stages.code2wav import Code2WavSettings
from omni_backend.stages.omni_voice import OmniVoice
from omni_backend.stages.talker import TalkerSettings
from omni_backend.stages.tensors import string_tensor
from omni_backend.stages.voice import VoiceWorker, build_worker, has_talker
from omni_backend.vocabulary import ErrorKind, StageError

PROMPT = 4  # thinker prompt rows
SEED = 7
CODEC_TOKENS = 13  # a chunk of a DiT block (12 codec frames in the tiny model), then a last one of one frame


class Sink:
    def __init__(self):
        self.sent, self.errors, self.closed = [], [], 0

    def send(self, outputs, final):
        assert not self.ended
        self.sent.append((outputs, final))

    def fail(self, error):
        assert not self.ended
        self.errors.append(error)

    def close(self):
        assert not self.ended
        self.closed += 1

    @property
    def ended(self):
        return bool(self.errors or self.closed or (self.sent and self.sent[-1][1]))

    def waveform(self):
        return np.concatenate([out["waveform"] for out, _ in self.sent]) if self.sent else np.zeros(0, np.float32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build("qwen2_5_omni", tmp_path_factory.mktemp("omni-voice") / "checkpoint", log=lambda _: None))


def make_voice(folder, codec_tokens=12):
    return OmniVoice(folder, TalkerSettings(max_num_seqs=4, greedy=True, max_codec_tokens=codec_tokens),
                     # no vocoder context: the tiny BigVGAN costs ~0.2 s per 10 ms of speech on this CPU
                     Code2WavSettings(chunk_blocks=1, future_blocks=0, vocoder_context=0, num_steps=2),
                     dtype="float32")


def rows(count, width, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, width, generator=generator), torch.randn(count, width, generator=generator) * 0.1


def push(key, hidden=None, embeds=None, finish="", first=False, voice="Chelsie"):
    arrays = {"stream_key": string_tensor(key), "finish_reason": string_tensor(finish)}
    if hidden is not None:
        arrays.update(hidden_states=hidden.numpy(), input_embeds=embeds.numpy())
    if first:
        arrays.update(voice=string_tensor(voice), seed=np.array([SEED], np.int64),
                      prompt_tokens=np.array([PROMPT], np.int32))
    return arrays


def drain(worker):
    while worker.voice.has_work() or not worker._inbox.empty():
        worker.run_once(block=False)


def test_an_answer_streams_through_its_requests_and_equals_omni_voice_driven_directly(folder):
    """Three requests (prompt and 12 reply rows, one more row, the end): the first is applied before any chunk
    exists (final flag alone), the second gets the chunk made while the talker waited for its row and its final
    flag, the last gets the rest to the final chunk (finish_reason "stop", indices in order); joined, the waveform
    equals OmniVoice's own (same seed, exactly); the talker's blocks are free after."""
    direct = make_voice(folder, codec_tokens=CODEC_TOKENS)
    hidden, embeds = rows(PROMPT + 13, direct.inputs.width)
    direct.start("a", "Chelsie", SEED, PROMPT)
    direct.push("a", hidden, embeds, finished=True)
    expected = []
    while direct.has_work():
        expected += direct.step()
    expected_wave = torch.cat([chunk.audio for chunk in expected]).numpy()

    snapshots = []
    worker = VoiceWorker(make_voice(folder, codec_tokens=CODEC_TOKENS), ("Chelsie", "Ethan"), 24000, start=False,
                         publish=snapshots.append)
    first, second, last = Sink(), Sink(), Sink()
    worker.submit(push("a", hidden[:-1], embeds[:-1], first=True), first)
    drain(worker)  # until the talker waits for the thinker's next row
    worker.submit(push("a", hidden[-1:], embeds[-1:]), second)
    worker.run_once(block=False)
    worker.submit(push("a", finish="stop"), last)
    drain(worker)
    assert first.closed == 1 and not first.sent  # its answer had no chunk yet when it was applied
    assert second.sent and second.sent[-1][1] and all(not final for _, final in second.sent[:-1])
    assert last.sent[-1][1] and last.sent[-1][0]["finish_reason"][0] == b"stop"
    outputs = [out for out, _ in second.sent + last.sent]
    assert [int(out["chunk_index"][0]) for out in outputs] == list(range(len(expected)))
    assert all(int(out["sample_rate"][0]) == 24000 for out in outputs)
    joined = np.concatenate([second.waveform(), last.waveform()])
    np.testing.assert_array_equal(joined, expected_wave)
    assert worker.answers == {} and not worker.voice.has_work()
    worker._snapshot(force=True)
    assert sum(len(snap.first_audio_s) for snap in snapshots) == 1
    assert [size for snap in snapshots for size in snap.code2wav_batches] == [1] * len(expected)
    talker = worker.voice.talker.runner
    assert talker.block_manager.num_free_blocks == talker.num_blocks


def test_a_cancel_frees_the_answer_in_both_engines_and_ends_its_streaming_request(folder):
    """Also the metrics snapshots: the talker's blocks in use and the answer while it runs, none after the cancel
    (published before the worker waits idle)."""
    snapshots = []
    worker = VoiceWorker(make_voice(folder, codec_tokens=400), ("Chelsie", "Ethan"), 24000, start=False,
                         publish=snapshots.append)
    hidden, embeds = rows(PROMPT + 2, worker.voice.inputs.width, seed=1)
    listener, cancel = Sink(), Sink()
    worker.submit(push("b", hidden, embeds, finish="stop", first=True), listener)
    for _ in range(4):
        worker.run_once(block=False)
    talker = worker.voice.talker.runner
    assert talker.block_manager.num_free_blocks < talker.num_blocks
    worker._snapshot(force=True)
    running = snapshots[-1]
    assert running.talker_kv_blocks_used == talker.num_blocks - talker.block_manager.num_free_blocks > 0
    assert running.answers == 1 and running.talker_kv_blocks_total == talker.num_blocks
    codes = len(worker.voice.code2wav.answers["b"].codes)  # one per talker step that gave the answer a token
    assert [size for snap in snapshots for size in snap.talker_batches] == [1] * codes and codes > 0
    worker.submit({"cancel": string_tensor("b")}, cancel)
    worker.run_once(block=False)
    worker._snapshot(force=True)
    assert (snapshots[-1].talker_kv_blocks_used, snapshots[-1].answers, snapshots[-1].cancelled) == (0, 0, 1)
    assert cancel.closed == 1 and listener.closed == 1 and not listener.errors
    assert talker.block_manager.num_free_blocks == talker.num_blocks
    assert worker.answers == {} and worker.voice.feeds == {} and not worker.voice.has_work()


def test_refused_voices_rows_and_keys_end_only_their_request(folder):
    worker = VoiceWorker(make_voice(folder), ("Chelsie", "Ethan"), 24000, start=False)
    hidden, embeds = rows(PROMPT + 2, worker.voice.inputs.width, seed=2)
    check, unknown, bad_rows, no_answer, good = Sink(), Sink(), Sink(), Sink(), Sink()
    worker.submit({"voice": string_tensor("Ethan")}, check)
    assert [(json.loads(out["voice"][0]), final) for out, final in check.sent] == [(["Chelsie", "Ethan"], True)]
    worker.submit(push("c", hidden, embeds, finish="stop", first=True, voice="Nobody"), unknown)
    error = unknown.errors[0]
    assert isinstance(error, StageError) and error.kind is ErrorKind.INVALID_ARGUMENT and error.field == "voice"
    assert "Chelsie, Ethan" in str(error)
    worker.submit(push("d", hidden[:, :3], embeds[:, :2], first=True), bad_rows)  # rows of different widths
    worker.submit(push("e", hidden, embeds), no_answer)  # no voice: never started
    worker.submit(push("f", hidden, embeds, finish="stop", first=True), good)
    drain(worker)
    assert "differ" in str(bad_rows.errors[0])
    assert "names no answer in progress" in str(no_answer.errors[0])
    assert good.sent[-1][1] and not good.errors and good.waveform().size > 0
    talker = worker.voice.talker.runner
    assert talker.block_manager.num_free_blocks == talker.num_blocks and worker.answers == {}


def test_the_stage_is_built_only_for_a_checkpoint_with_a_talker(folder, tmp_path):
    assert has_talker(folder)
    text_model = tmp_path / "text"
    text_model.mkdir()
    (text_model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert not has_talker(text_model) and not has_talker(tmp_path / "missing")
    assert build_worker({"model_path": str(text_model)}) is None
    worker = build_worker({"model_path": folder, "device": "cpu", "dtype": "float32", "code2wav_num_steps": "2"})
    try:
        assert worker.voices == ("Chelsie", "Ethan") and worker.sample_rate == 24000
        assert worker.voice.code2wav.settings.num_steps == 2
    finally:
        worker.shutdown()


@pytest.mark.parametrize("delay, batches", [(0, {1: 2}), (8, {2: 1})])
def test_a_ready_chunk_waits_up_to_max_delay_steps_for_others_to_batch_with(folder, delay, batches):
    """Two answers of one chunk each (12 codec tokens), the second started 3 talker steps after the first: at
    once, two DiT calls of one; allowed to wait 8 talker steps, one call of both."""
    voice = OmniVoice(folder, TalkerSettings(max_num_seqs=4, greedy=True, max_codec_tokens=12),
                      Code2WavSettings(chunk_blocks=1, future_blocks=0, vocoder_context=0, num_steps=2,
                                       max_delay_steps=delay), dtype="float32")
    hidden, embeds = rows(PROMPT + 13, voice.inputs.width, seed=3)
    chunks = []
    for request_id in ("first", "second"):
        voice.start(request_id, "Chelsie", SEED, PROMPT)
        voice.push(request_id, hidden, embeds, finished=True)
        for _ in range(3):
            chunks += voice.step()
    while voice.has_work():
        chunks += voice.step()
    assert dict(voice.code2wav.batch_sizes) == batches
    assert sorted(c.request_id for c in chunks if c.final) == ["first", "second"]


def wait_until(condition, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_failing_step_ends_the_answers_in_progress_and_the_worker_goes_on(folder):
    """A talker or code2wav fault (out of memory, a device error) must not kill the worker thread: the answers it
    held end with an INTERNAL error, their KV is freed, and the next answer is spoken."""
    worker = VoiceWorker(make_voice(folder), ("Chelsie", "Ethan"), 24000)  # its own thread, as served
    try:
        hidden, embeds = rows(PROMPT + 2, worker.voice.inputs.width, seed=3)
        real_step, calls = worker.voice.code2wav.step, []

        def failing_once():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected device fault")
            return real_step()

        worker.voice.code2wav.step = failing_once
        held = Sink()
        worker.submit(push("g", hidden, embeds, finish="stop", first=True), held)
        wait_until(lambda: held.ended)
        error = held.errors[0]
        assert isinstance(error, StageError) and error.kind is ErrorKind.INTERNAL
        assert "injected device fault" in str(error) and not held.sent
        talker = worker.voice.talker.runner
        wait_until(lambda: worker.answers == {})
        assert talker.block_manager.num_free_blocks == talker.num_blocks
        after = Sink()
        worker.submit(push("h", hidden, embeds, finish="stop", first=True), after)
        wait_until(lambda: after.ended)
        assert not after.errors and after.sent[-1][1] and after.waveform().size > 0
    finally:
        worker.shutdown()
