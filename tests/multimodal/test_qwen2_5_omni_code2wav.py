"""Qwen2.5-Omni's code2wav stage (omni_backend/stages/code2wav.py) on the tiny checkpoint, float32: the whole
utterance against transformers' `Qwen2_5OmniToken2WavModel`, and the chunks streamed for several answers at once
against the whole.

The tiny random vocoder's waveform peaks near 5e-7 (its weights are initialised at std 0.02), so tolerances are
relative to each waveform's peak."""

from __future__ import annotations

import pytest
import torch

from omni_backend.setup.tiny_hf_multimodal import build
from omni_backend.stages.code2wav import Code2Wav, Code2WavSettings
from omni_backend.vocabulary import ErrorKind, StageError

CODES = 30  # codec frames per answer: 2.5 DiT blocks of the tiny model (12 codec frames each)
WHOLE_TOLERANCE = 1e-5  # ours whole vs transformers, relative to the peak (same noise, same ops; seen: 0)
# Joined chunks vs the whole, relative to the peak. The tiny DiT's attention gates are small, so what a window
# misses of the flow is below float32 rounding here (seen: 4e-7); misplaced noise, codes or vocoder context would
# be of the order of the signal. A trained DiT carries more across blocks: measure it on a real folder.
CHUNK_TOLERANCE = 1e-4
STEPS = 3  # time points of the flow (10 by default): two Runge-Kutta steps keep the test fast


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build("qwen2_5_omni", tmp_path_factory.mktemp("omni-code2wav") / "checkpoint", log=lambda _: None))


def answers() -> list[tuple[str, str, int, list[int]]]:
    """(request id, voice, seed, codes) of two answers of different lengths and voices."""
    generator = torch.Generator().manual_seed(0)
    return [(f"a{i}", voice, 7 + i, torch.randint(0, 8193, (CODES - 6 * i,), generator=generator).tolist())
            for i, voice in enumerate(("Chelsie", "Ethan"))]


def spoken(code2wav: Code2Wav, given: list[tuple], piece: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Every answer at once, its codes added `piece` at a time between steps; each answer's chunks joined, and how
    many chunks had gone out before each answer's last code came."""
    joined = {request_id: [] for request_id, _, _, _ in given}
    early = {}
    for request_id, voice, seed, _ in given:
        code2wav.start(request_id, voice, seed)
    fed = 0
    while fed < max(len(codes) for *_, codes in given) or code2wav.has_work():
        for request_id, _, _, codes in given:
            if fed < len(codes):
                code2wav.add(request_id, codes[fed:fed + piece], finished=fed + piece >= len(codes))
                if fed + piece >= len(codes):
                    early[request_id] = len(joined[request_id])
        fed += piece
        for chunk in code2wav.step():
            assert chunk.index == len(joined[chunk.request_id])
            joined[chunk.request_id].append(chunk)
    for chunks in joined.values():
        assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    return {request_id: torch.cat([c.audio for c in chunks]) for request_id, chunks in joined.items()}, early


def test_whole_utterances_equal_transformers_and_streamed_chunks_equal_the_whole(folder):
    from transformers import Qwen2_5OmniForConditionalGeneration

    given = answers()
    whole, _ = spoken(Code2Wav(folder, Code2WavSettings(chunk_blocks=100, num_steps=STEPS)), given, piece=CODES)
    reference = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    request_id, voice, seed, codes = given[0]
    speaker = reference.speaker_map[voice]
    torch.manual_seed(seed)
    with torch.no_grad():
        expected = reference.token2wav(torch.tensor([codes]), conditioning=speaker["cond"][None].float(),
                                       reference_mel=speaker["ref_mel"][None].float(), num_steps=STEPS).reshape(-1)
    peak = expected.abs().max()
    assert peak > 0 and whole[request_id].shape == expected.shape == (len(codes) * 2 * 240,)
    assert (whole[request_id] - expected).abs().max() <= WHOLE_TOLERANCE * peak

    streaming = Code2Wav(folder, Code2WavSettings(chunk_blocks=1, past_blocks=1, future_blocks=1, num_steps=STEPS))
    joined, early = spoken(streaming, given, piece=5)
    for request_id, _, _, codes in given:
        assert joined[request_id].shape == whole[request_id].shape
        peak = whole[request_id].abs().max()
        assert (joined[request_id] - whole[request_id]).abs().max() <= CHUNK_TOLERANCE * peak, request_id
    assert early["a0"] >= 1  # the longer answer's first chunk went before its last code came
    assert max(streaming.batch_sizes) > 1  # answers' windows went through the DiT together
    assert streaming.answers == {}


def test_unknown_voices_and_codes_outside_the_codec_vocabulary_are_refused(folder):
    code2wav = Code2Wav(folder, Code2WavSettings())
    with pytest.raises(StageError) as caught:
        code2wav.start("x", "Nobody", 0)
    assert caught.value.kind == ErrorKind.INVALID_ARGUMENT and "Chelsie, Ethan" in str(caught.value)
    code2wav.start("x", "Ethan", 0)
    with pytest.raises(ValueError, match=r"\[0, 8193\]"):
        code2wav.add("x", [5, 8292])
    assert code2wav.answers == {}
    code2wav.start("y", "Ethan", 0)
    code2wav.add("y", [], finished=True)  # an answer without codes still ends, with an empty chunk
    assert [(c.request_id, c.audio.numel(), c.final) for c in code2wav.step()] == [("y", 0, True)]


def test_past_max_batch_answers_take_turns(folder):
    code2wav = Code2Wav(folder, Code2WavSettings(chunk_blocks=1, future_blocks=0, max_batch=1, num_steps=2))
    for request_id in ("a", "b"):
        code2wav.start(request_id, "Chelsie", 0)
        code2wav.add(request_id, list(range(24)), finished=True)
    order = []
    while code2wav.has_work():
        order += [(c.request_id, c.index, c.final) for c in code2wav.step()]
    assert order == [("a", 0, False), ("b", 0, False), ("a", 1, True), ("b", 1, True)]
    assert code2wav.batch_sizes == {1: 4}


def test_chunks_double_in_size_up_to_max_chunk_blocks(folder):
    """An answer of 9 blocks in chunks of 1, 2, 4, then the 2 blocks left (the first small for the time to first
    audio, later ones larger: each window recomputes its look-back and look-ahead)."""
    code2wav = Code2Wav(folder, Code2WavSettings(chunk_blocks=1, max_chunk_blocks=4, num_steps=2))
    code2wav.start("a", "Chelsie", 0)
    code2wav.add("a", list(range(9 * code2wav.block)), finished=True)
    sizes = []
    while code2wav.has_work():
        sizes += [c.audio.numel() // (code2wav.block * code2wav.repeats * code2wav.hop) for c in code2wav.step()]
    assert sizes == [1, 2, 4, 2]
