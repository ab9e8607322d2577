"""Qwen2.5-Omni speaking with its own voice (issue 27), against transformers on the tiny checkpoint (float32): the
thinker's hidden states and input embeddings for the talker, the talker's codec ids, code2wav's waveform."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omni_reference import messages, transformers_inputs, transformers_reference
from test_qwen2_5_omni import engine_request, folder, make_engine, ours, prepare, reference  # noqa: F401 (fixtures)

from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.stages.code2wav import Code2WavSettings
from omni_backend.stages.omni_voice import OmniVoice
from omni_backend.stages.talker import (ReplyFeed, Speakers, TalkerInputs, TalkerRequest, TalkerSettings,
                                        engine_config, thinker_rows)
from omni_backend.vocabulary import StageError

REPLY = 24  # thinker tokens per answer (enough to outgrow the tight KV cache below)
HIDDEN_TOLERANCE = 1e-5  # float32, absolute, on rows of magnitude up to ~3.5 (seen: 8.3e-7 at most)




def transformers_rows(thinker, inputs, case: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    """transformers' greedy reply and the rows `Qwen2_5OmniForConditionalGeneration.generate` hands its talker:
    layer-0 input embeddings and last-layer hidden states of the prompt and of each reply token fed back."""
    with torch.no_grad():
        out = thinker.generate(**inputs, use_audio_in_video=case == "video_audio", max_new_tokens=REPLY,
                               do_sample=False, output_hidden_states=True, return_dict_in_generate=True)
    embeds = torch.cat([step[0][0] for step in out.hidden_states]).numpy()
    hidden = torch.cat([step[-1][0] for step in out.hidden_states]).numpy()
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), hidden, embeds


def engine_rows(engine, requests: list[dict], max_tokens: int = REPLY) -> list[tuple[list[int], np.ndarray,
                                                                                      np.ndarray]]:
    """Every request at once, greedy, streamed, with hidden states: each one's (tokens, hidden rows, embedding rows),
    joined from all its outputs."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stream=True,
                            return_hidden_states=True)
    outputs: dict[str, list] = {}
    for index, request in enumerate(requests):
        engine.add_request(f"r{index}", params=params, **request)
        outputs[f"r{index}"] = []
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id].append(output)
    rows = []
    for index in range(len(requests)):
        joined = outputs[f"r{index}"][0]
        for later in outputs[f"r{index}"][1:]:
            joined = joined.followed_by(later)
        rows.append((joined.token_ids, joined.hidden_states.numpy(), joined.input_embeds.numpy()))
    return rows


def test_thinker_rows_equal_transformers_also_after_preemption_and_beside_prefix_cache_hits(folder, reference,
                                                                                           ours):
    """Text, image and audio prompts: the engine's rows (prompt, then each reply token fed back; the last token
    sampled has none) are transformers' within HIDDEN_TOLERANCE, in one batch, again from a warm prefix cache (the
    prompts' blocks are cached; a request with hidden states still computes its prompt) and through a KV cache too
    small for the three answers (preemptions: positions recomputed, each row taken once). A request without
    hidden states carries none."""
    processor, thinker = reference
    cases = ("text", "image", "audio")
    expected = [transformers_rows(thinker, transformers_inputs(processor, case), case) for case in cases]
    requests = [engine_request(*prepare(ours, messages(case))) for case in cases]

    def check(rows):
        for request, (tokens, hidden, embeds), (want_tokens, want_hidden, want_embeds) in zip(requests, rows,
                                                                                             expected):
            assert tokens == want_tokens
            assert hidden.shape == want_hidden.shape == embeds.shape == want_embeds.shape
            assert hidden.shape[0] == len(request["prompt_token_ids"]) + REPLY - 1
            np.testing.assert_allclose(hidden, want_hidden, rtol=0, atol=HIDDEN_TOLERANCE)
            np.testing.assert_allclose(embeds, want_embeds, rtol=0, atol=HIDDEN_TOLERANCE)

    engine = make_engine(folder)
    check(engine_rows(engine, requests))
    check(engine_rows(engine, requests))
    assert engine.runner.block_manager.prefix_cache_hits == 0  # nothing reused: the rows need the computation
    plain = engine.generate([requests[0]["prompt_token_ids"]], SamplingParams(max_tokens=2, temperature=0.0))
    assert plain[0].hidden_states is None and plain[0].input_embeds is None
    assert engine.runner.block_manager.prefix_cache_hits > 0  # the text prompt's blocks were cached

    blocks = sum(-(-(len(r["prompt_token_ids"]) + 1) // 16) for r in requests) + 1
    tight = make_engine(folder, num_kv_blocks=blocks, max_num_batched_tokens=256)
    check(engine_rows(tight, requests))
    assert tight.scheduler.num_preemptions > 0


CODEC_TOKENS = 40  # talker tokens per answer at most (the tiny random talker rarely stops by itself)
FLOW_STEPS = 3  # time points of code2wav's flow (10 by default; fewer keeps the tests fast)
SEED = 11  # of code2wav's noise (transformers' generate: the global seed)
WAVE_TOLERANCE = 1e-4  # joined chunks vs generate's waveform, relative to its peak (tests/..._code2wav.py says why)


@pytest.fixture(scope="module")
def omni(folder):
    """transformers' whole Qwen2.5-Omni (float32), its talker's `generate` recorded (`omni.talker_codes`).

    transformers 5.24's `generate` hands its talker the image's pixel values, which the talker's own `generate`
    refuses ("model_kwargs are not used by the model: ['pixel_values']"); the recorder drops them (the talker reads
    only the grids, for its position ids)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    model.talker_codes = []
    generate = model.talker.generate

    def recorded(*args, **kwargs):
        kwargs = {key: value for key, value in kwargs.items() if key not in ("pixel_values", "pixel_values_videos")}
        out = generate(*args, **kwargs)
        model.talker_codes.append(out[0, kwargs["input_ids"].shape[1]:].tolist())
        return out

    model.talker.generate = recorded
    return model


def padded(inputs: dict) -> dict:
    """transformers' inputs left-padded by one masked token (`transformers_speech` says why)."""
    pad = torch.zeros_like(inputs["input_ids"][:, :1])
    return dict(inputs, input_ids=torch.cat([pad, inputs["input_ids"]], dim=1),
                attention_mask=torch.cat([pad, inputs["attention_mask"]], dim=1))


def transformers_speech(omni, inputs, voice: str) -> tuple[list[int], list[int], torch.Tensor]:
    """`generate`'s greedy reply, its greedy talker's codec ids (up to the first stop id) and its waveform.

    The prompt goes in left-padded by one masked token (`padded`). transformers 5 drops an attention mask of all ones before
    the first forward pass (generation/utils.py, "We can drop the mask altogether if it's all 1s"), and the talker's
    forward adds the codec pad and bos embeddings to its last two prompt rows and gives its prompt the thinker's
    M-RoPE ids only when it gets a mask; so an unpadded single prompt would meet a talker without them, unlike the
    talker as released (transformers 4.5x always passed the mask) and unlike a padded batch. The masked token
    changes nothing else: it is left out of attention, and position ids count from the first real token."""
    inputs = padded(inputs)
    with torch.no_grad():
        torch.manual_seed(SEED)
        text, wav = omni.generate(**inputs, speaker=voice, thinker_max_new_tokens=REPLY, thinker_do_sample=False,
                                  talker_max_new_tokens=CODEC_TOKENS, talker_do_sample=False,
                                  token2wav_num_steps=FLOW_STEPS)
    codes = omni.talker_codes[-1]
    stops = [i for i, code in enumerate(codes) if code in (omni.talker.codec_pad_token, omni.talker.codec_eos_token)]
    return text[0, inputs["input_ids"].shape[1]:].tolist(), codes[:stops[0] if stops else len(codes)], wav


def talker_answers(talker, inputs: TalkerInputs, answers: list[tuple], chunk: int = 3) -> tuple[list, int]:
    """Our talker's greedy codec ids for thinker answers `(voice, rows, request, media positions)` spoken at once:
    each answer's reply rows are fed `chunk` at a time, answer i's only every (i + 1)-th step it waits for them (so
    the answers run ahead of their rows at different paces), the text-end and pad rows after the last. Returns the
    codes in order and how many steps decoded one answer while another waited for its rows."""
    replies = {}
    settings = TalkerSettings(greedy=True, max_codec_tokens=CODEC_TOKENS)
    for index, (voice, (_, hidden, embeds), request, media) in enumerate(answers):
        count = len(request["prompt_token_ids"])
        media_positions = torch.from_numpy(media.astype(np.int64)) if media is not None else None
        rows = thinker_rows(torch.from_numpy(hidden), torch.from_numpy(embeds), media_positions)
        # the rows arrive in pieces as a thinker streams them (thinker_rows per piece equals it whole)
        pieces = [thinker_rows(torch.from_numpy(hidden[s:s + 5]), torch.from_numpy(embeds[s:s + 5]),
                               media_positions, first=s) for s in range(0, hidden.shape[0], 5)]
        assert torch.equal(torch.cat(pieces), rows)
        positions = request.get("prompt_positions")
        ids, prompt, rope = inputs.prompt(voice, rows[:count], rows[count],
                                          positions.positions if positions is not None else None)
        talker.add_request(f"t{index}", ids, inputs.sampling(settings), prompt, rope, inputs.addends())
        replies[f"t{index}"] = [rows[count + 1:], 0]
    codes = {request_id: [] for request_id in replies}
    overtakes = 0
    while talker.has_unfinished():
        waiting = {r for r, state in talker.requests.items() if not state.seq.inputs_ready()}
        stepped = set()
        for output in talker.step():
            codes[output.request_id] += output.token_ids
            stepped.add(output.request_id)
        overtakes += bool(waiting) and bool(stepped - waiting)
        for index, (request_id, reply) in enumerate(replies.items()):
            state = talker.requests.get(request_id)
            if state is not None and not state.seq.inputs_ready() and talker.num_steps % (index + 1) == 0:
                rows, fed = reply
                talker.extend_inputs(request_id, rows[fed:fed + chunk],
                                     inputs.tail if fed + chunk >= rows.shape[0] else None)
                reply[1] = fed + chunk
    return list(codes.values()), overtakes


def test_greedy_talker_codec_ids_equal_transformers(folder, omni, ours):
    """Text, image and audio prompts, voices alternating, spoken in one talker batch: the thinker's rows, fed as
    they would stream, through our talker engine give transformers' greedy talker codec ids (repetition penalty and
    codec-bos suppression kept), token for token; an answer waiting for its rows never holds back the others."""
    processor, _ = transformers_reference(folder)
    inputs = TalkerInputs(folder, Speakers.load(folder))
    cases = (("text", "Chelsie"), ("image", "Ethan"), ("audio", "Chelsie"))
    expected = [transformers_speech(omni, transformers_inputs(processor, case), voice) for case, voice in cases]
    prepared = [prepare(ours, messages(case)) for case, _ in cases]
    requests = [engine_request(out, spliced) for out, spliced in prepared]
    rows = engine_rows(make_engine(folder), requests)
    assert [r[0] for r in rows] == [reply for reply, _, _ in expected]
    talker = LLMEngine(engine_config(folder, TalkerSettings(max_num_seqs=4), device="cpu", dtype="float32"))
    answers = [(voice, r, request, spliced.get("prompt_embed_positions"))
               for (_, voice), r, request, (_, spliced) in zip(cases, rows, requests, prepared)]
    codes, overtakes = talker_answers(talker, inputs, answers)
    for (case, _), ours_codes, (_, want, _) in zip(cases, codes, expected):
        assert ours_codes == want, case
        assert len(set(want)) > 1
    assert overtakes > 0
    assert talker.runner.block_manager.num_free_blocks == talker.runner.num_blocks  # every block freed


def test_a_spoken_answer_streams_through_three_engines_and_equals_transformers_generate(folder, omni, ours):
    """Thinker, talker and code2wav stepped in turn (`OmniVoice`), each stage's output handed on as it comes:
    transformers' greedy reply and talker codes, `generate`'s waveform within WAVE_TOLERANCE of its peak (same
    seed), and the first audio chunk out before the thinker's last token; both engines' KV blocks freed."""
    processor, _ = transformers_reference(folder)
    case, voice = "image", "Ethan"
    reply, expected_codes, wav = transformers_speech(omni, transformers_inputs(processor, case), voice)
    thinker = make_engine(folder)
    speech = OmniVoice(folder, TalkerSettings(max_num_seqs=2, greedy=True, max_codec_tokens=CODEC_TOKENS),
                       Code2WavSettings(chunk_blocks=1, future_blocks=0, num_steps=FLOW_STEPS), dtype="float32")
    codes = []
    real_add = speech.code2wav.add
    speech.code2wav.add = lambda request_id, new, finished: (codes.extend(new), real_add(request_id, new, finished))
    out, spliced = prepare(ours, messages(case))
    request = engine_request(out, spliced)
    thinker.add_request("s", params=SamplingParams(max_tokens=REPLY, temperature=0.0, ignore_eos=True, stream=True,
                                                   return_hidden_states=True), **request)
    media = spliced.get("prompt_embed_positions")
    speech.start("s", voice, SEED, len(request["prompt_token_ids"]), request["prompt_positions"].positions,
                 torch.from_numpy(media.astype(np.int64)))
    tokens, chunks, step, thinker_done, first_audio = [], [], 0, None, None
    while not chunks or not chunks[-1].final:
        step += 1
        for output in thinker.step():
            tokens += output.token_ids
            speech.push("s", output.hidden_states, output.input_embeds, output.finished)
            thinker_done = step if output.finished else None
        chunks += speech.step()
        first_audio = first_audio or (step if chunks else None)
    assert tokens == reply and codes == expected_codes
    joined = torch.cat([chunk.audio for chunk in chunks])
    assert joined.shape == wav.shape and len(chunks) > 2 and chunks[-1].error is None
    assert (joined - wav).abs().max() <= WAVE_TOLERANCE * wav.abs().max()
    assert first_audio < thinker_done
    assert not speech.has_work() and speech.feeds == {}
    assert speech.talker.runner.block_manager.num_free_blocks == speech.talker.runner.num_blocks


def test_a_failed_talker_or_refused_codes_end_that_answer_alone(folder):
    """Codes outside code2wav's vocabulary end their answer with an error chunk and free its talker blocks; the
    other answer goes on to its final chunk."""
    inputs = TalkerInputs(folder, Speakers.load(folder))
    speech = OmniVoice(folder, TalkerSettings(max_num_seqs=2, greedy=True, max_codec_tokens=4),
                       Code2WavSettings(chunk_blocks=1, num_steps=2), dtype="float32")
    hidden = torch.randn(6, inputs.width)
    for request_id in ("bad", "good"):
        speech.start(request_id, "Chelsie", 0, 4)
        speech.push(request_id, hidden, torch.zeros_like(hidden), finished=True)
    real_add = speech.code2wav.add
    speech.code2wav.add = lambda request_id, codes, finished: real_add(
        request_id, [9000] if request_id == "bad" else codes, finished)
    chunks = []
    while speech.has_work():
        chunks += speech.step()
    bad = [c for c in chunks if c.request_id == "bad"]
    assert len(bad) == 1 and bad[0].final and "code2wav refused" in bad[0].error and "[0, 8193]" in bad[0].error
    good = [c for c in chunks if c.request_id == "good"]
    assert good[-1].final and good[-1].error is None and sum(c.audio.numel() for c in good) == 4 * 2 * 240
    assert speech.talker.runner.block_manager.num_free_blocks == speech.talker.runner.num_blocks
    with pytest.raises(StageError, match="voice"):
        speech.start("x", "Nobody", 0, 4)


def test_the_reply_feed_hands_over_rows_as_they_come_and_a_one_token_reply(folder):
    inputs = TalkerInputs(folder, Speakers.load(folder))
    width, count = inputs.width, 4
    hidden, embeds = torch.randn(9, width), torch.randn(9, width)
    rows = hidden + embeds
    feed = ReplyFeed(inputs, "Chelsie", count)
    assert feed.push(hidden[:3], embeds[:3], finished=False) == TalkerRequest()  # the prompt is not complete
    got = feed.push(hidden[3:6], embeds[3:6], finished=False)  # prompt rows, the first reply row, one more
    ids, prompt, positions = got.prompt
    assert ids == [inputs.codec_mask] * count + [inputs.codec_pad, inputs.codec_bos] and positions is None
    torch.testing.assert_close(prompt.embeds[:count], rows[:count], rtol=0, atol=1e-6)
    torch.testing.assert_close(prompt.embeds[-1], rows[count] + inputs.codec_bos_row, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.rows, rows[5:6], rtol=0, atol=1e-6)
    got = feed.push(hidden[6:9], embeds[6:9], finished=True)
    assert got.prompt is None and torch.equal(got.tail, inputs.tail)
    torch.testing.assert_close(got.rows, rows[6:9], rtol=0, atol=1e-6)

    short = ReplyFeed(inputs, "Ethan", count).push(hidden[:count], embeds[:count], finished=True)
    torch.testing.assert_close(short.prompt[1].embeds[-1], inputs.tail[0] + inputs.codec_bos_row, rtol=0, atol=0)
    assert short.rows is None and torch.equal(short.tail, inputs.tail[1:])
    with pytest.raises(ValueError, match="must return hidden states"):
        ReplyFeed(inputs, "Ethan", count).push(None, None, finished=True)
    with pytest.raises(StageError, match="Chelsie, Ethan"):
        ReplyFeed(inputs, "Nobody", count)


def test_talker_sampling_is_transformers_generate_defaults(folder):
    """What `Qwen2_5OmniForConditionalGeneration.generate` samples its talker with, read from its signature."""
    import inspect

    from transformers import Qwen2_5OmniForConditionalGeneration

    defaults = {name: parameter.default for name, parameter
                in inspect.signature(Qwen2_5OmniForConditionalGeneration.generate).parameters.items()}
    inputs = TalkerInputs(folder, Speakers.load(folder))
    params = inputs.sampling(TalkerSettings(max_codec_tokens=77), seed=3)
    assert (params.top_k, params.top_p, params.temperature, params.repetition_penalty) == (
        defaults["talker_top_k"], defaults["talker_top_p"], defaults["talker_temperature"],
        defaults["talker_repetition_penalty"])
    assert sorted(params.stop_token_ids) == sorted(defaults["talker_eos_token_id"])
    assert params.suppress_token_ids == [inputs.codec_bos] and (params.max_tokens, params.seed) == (77, 3)
    greedy = inputs.sampling(TalkerSettings(greedy=True))
    assert greedy.temperature == 0 and greedy.repetition_penalty == params.repetition_penalty
