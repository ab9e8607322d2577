"""Qwen2.5-Omni's thinker served from its folder (issue 26): a tiny random checkpoint built with transformers' own
classes (omni_backend/setup/tiny_hf_multimodal.py); preprocess, the encoder stages and the engine must give
transformers' prompt ids, M-RoPE position ids, prompt embeddings and greedy tokens (float32) for text, image,
audio, video and video-with-its-audio prompts, also under chunked prefill, preemption and prefix-cache hits
(transformers' side of the video prompts: omni_reference.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.media_inputs import audio_bytes, video_bytes, video_part
from omni_reference import (CASES, LONG, NEW_TOKENS, QUESTION, SAMPLED, VIDEO_FPS, clip_frames,
                            messages, transformers_embeds, transformers_reference, transformers_greedy, transformers_inputs,
                            transformers_positions)

from omni_backend.engine import prefix_cache
from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import PromptEmbeds, PromptPositions, Sequence
from omni_backend.setup.tiny_hf_multimodal import build
from omni_backend.stages.media_encoder import create_stage, encoder_calls, splice_embeddings
from omni_backend.stages.preprocess import Preprocessor
from omni_backend.stages.preprocess_media import MediaConfig
from omni_backend.stages.tensors import string_tensor
from omni_backend.vocabulary import FieldError


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build("qwen2_5_omni", tmp_path_factory.mktemp("omni") / "checkpoint", log=lambda _: None))


@pytest.fixture(scope="module")
def reference(folder):
    return transformers_reference(folder)


@pytest.fixture(scope="module")
def ours(folder):
    """(preprocess, encoder stage by kind) of the product for the folder."""
    stage = Preprocessor.from_pretrained(folder, 2048, MediaConfig.from_parameters({"llm_model_path": folder}))
    return stage, {kind: create_stage(kind, {"llm_model_path": folder}) for kind in ("image", "audio")}


def prepare(ours, chat: list[dict]) -> tuple[dict, dict]:
    """Preprocess's outputs and the llm inputs (prompt embeddings spliced from our encoder stages, one call per
    item as the pipeline sends them)."""
    stage, encoders = ours
    out = stage.run({"text_input": string_tensor(json.dumps(chat)),
                     "max_tokens": np.array([NEW_TOKENS], dtype=np.int32)})
    parts = json.loads(out["media_parts"][0])
    if not parts:
        return out, {}
    calls = encoder_calls(parts, out["pixel_values"], out["input_features"])
    outputs = []
    for call in calls:
        if "input_features" in call.inputs:
            outputs.append(encoders["audio"].run([call.inputs["input_features"]],
                                                 [call.inputs["input_lengths"].reshape(-1)])[0])
        else:
            outputs.append(encoders["image"].run([call.inputs["pixel_values"]])[0])
    return out, splice_embeddings(parts, out["media_positions"], calls, outputs)


def engine_request(out: dict, spliced: dict) -> dict:
    """`LLMEngine.add_request` keyword arguments for preprocess's outputs and the spliced embeddings."""
    request = {"prompt_token_ids": out["input_ids"].tolist()}
    if spliced:
        request["prompt_embeds"] = PromptEmbeds(torch.from_numpy(spliced["prompt_embed_positions"].astype(np.int64)),
                                                torch.from_numpy(spliced["prompt_embeds"]))
    if out["prompt_positions"].size:
        request["prompt_positions"] = PromptPositions(torch.from_numpy(out["prompt_positions"].astype(np.int64)))
    return request


def run(engine: LLMEngine, requests: list[dict], max_tokens: int = NEW_TOKENS) -> list:
    """Every request at once through `engine`, greedy; their final outputs in order."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for index, request in enumerate(requests):
        engine.add_request(f"r{index}", params=params, **request)
    finals = {}
    while engine.has_unfinished():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    return [finals[f"r{index}"] for index in range(len(requests))]


def make_engine(folder: str, **limits) -> LLMEngine:
    settings = {"num_kv_blocks": 128, "max_num_seqs": 8, "max_num_batched_tokens": 1024, **limits}
    return LLMEngine(EngineConfig(model_path=folder, dtype="float32", max_model_len=2048, **settings))


@pytest.mark.parametrize("case", CASES)
def test_prompt_ids_positions_and_embeddings_equal_transformers(folder, reference, ours, case):
    """Preprocess gives the processor's ids and transformers' `get_rope_index` ids; the encoder stages give the
    embeddings transformers merges into the prompt at the placeholders (a video's frames and, with its audio,
    the track's embeddings interleaved with them by time)."""
    processor, thinker = reference
    out, spliced = prepare(ours, messages(case))
    inputs = transformers_inputs(processor, case)
    assert out["input_ids"].tolist() == inputs["input_ids"][0].tolist()
    parts = json.loads(out["media_parts"][0])
    expected_kinds = {"text": [], "image": ["image"], "audio": ["audio"], "video": ["video"],
                      "video_audio": ["video", "audio"]}[case]
    assert [p["kind"] for p in parts] == expected_kinds
    if case == "text":
        assert out["prompt_positions"].shape == (3, 0)
        return
    np.testing.assert_array_equal(out["prompt_positions"], transformers_positions(thinker, inputs, case))
    if case.startswith("video"):
        assert parts[0]["items"] == len(SAMPLED) // 2  # one vision item per temporal patch
        assert out["prompt_positions"][0].max() >= 25  # the second patch's frames are one second later
    embeds = transformers_embeds(thinker, inputs, case)
    positions = spliced["prompt_embed_positions"]
    assert positions.size == sum(p["tokens"] for p in parts) > 0
    np.testing.assert_allclose(spliced["prompt_embeds"], embeds[positions], rtol=0, atol=1e-5)


def test_greedy_tokens_equal_transformers_generate(folder, reference, ours):
    """The five prompts in one batch: each answers transformers' greedy `generate` token for token."""
    processor, thinker = reference
    expected = [transformers_greedy(thinker, transformers_inputs(processor, case), case) for case in CASES]
    finals = run(make_engine(folder), [engine_request(*prepare(ours, messages(case))) for case in CASES])
    assert [f.token_ids for f in finals] == expected


def test_chunked_prefill_preemption_and_prefix_cache_hits_give_the_same_tokens(folder, reference, ours):
    """The image, video and video-with-audio prompts through a 32-token step budget (prefill chunks end inside the
    media runs), each twice (the second copies start from the prefix cache); then through a KV cache that holds
    their prompts but not their answers (preemptions: prompts recomputed from their M-RoPE ids). Every answer is
    transformers'."""
    processor, thinker = reference
    cases = ("image", "video", "video_audio")
    inputs = [transformers_inputs(processor, case) for case in cases]
    expected = [transformers_greedy(thinker, i, case, LONG) for i, case in zip(inputs, cases)]
    requests = [engine_request(*prepare(ours, messages(case))) for case in cases]
    engine = make_engine(folder, max_num_batched_tokens=32)
    first, second = run(engine, requests), run(engine, requests)
    assert [f.token_ids for f in first] == [e[:NEW_TOKENS] for e in expected]
    assert [f.token_ids for f in second] == [e[:NEW_TOKENS] for e in expected]
    assert all(f.cached_tokens > 0 for f in second)
    blocks = sum(-(-(len(r["prompt_token_ids"]) + 1) // 16) for r in requests) + 1
    tight = make_engine(folder, num_kv_blocks=blocks, max_num_batched_tokens=256, enable_prefix_caching=False)
    assert [f.token_ids for f in run(tight, requests, LONG)] == expected
    assert tight.scheduler.num_preemptions > 0


def test_the_same_embeddings_at_other_position_ids_never_share_a_block():
    """A block's name covers its M-RoPE ids: the same tokens and embeddings on another grid are another block."""
    tokens = [7] * 16 + [1]
    embeds = PromptEmbeds(torch.arange(16), torch.ones(16, 4))
    grid = torch.arange(17).expand(3, -1).clone()
    other = grid.clone()
    other[1:, :16] = torch.arange(16).view(4, 4).flatten() // 4  # a 4 x 4 grid instead of a 1 x 16 row
    names = [prefix_cache.block_name(Sequence("s", tokens, SamplingParams(), 0.0, embeds, PromptPositions(ids)), 0, 16)
             for ids in (grid, other, grid)]
    assert names[0] != names[1] and names[0] == names[2]


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    """A checkpoint whose language model (Llama) has no M-RoPE and whose processor reads no video."""
    return str(build("idefics3", tmp_path_factory.mktemp("idefics3") / "checkpoint", log=lambda _: None))


def test_position_ids_are_refused_by_a_model_without_m_rope_and_checked_for_shape(folder, idefics3):
    prompt = [1, 2, 3]
    with pytest.raises(ValueError, match="takes a token's index"):
        make_engine(idefics3, num_kv_blocks=8).make_sequence(
            "r", prompt, SamplingParams(max_tokens=2), prompt_positions=PromptPositions(torch.zeros(3, 3)))
    engine = make_engine(folder, num_kv_blocks=8)
    with pytest.raises(ValueError, match=r"must be \[3, 3\]"):
        engine.make_sequence("r", prompt, SamplingParams(max_tokens=2), prompt_positions=PromptPositions(
            torch.zeros(3, 2)))
    with pytest.raises(ValueError, match=r"must be \[3, 3\]"):
        engine.make_sequence("r", prompt, SamplingParams(max_tokens=2), prompt_positions=PromptPositions(
            torch.zeros(3)))
    with pytest.raises(ValueError, match="rotary positions"):
        engine.make_sequence("r", prompt, SamplingParams(max_tokens=2), prompt_positions=PromptPositions(
            torch.full((3, 3), 10 ** 6)))


def test_video_limits_and_bad_containers_are_refused_naming_the_part(folder, ours, tmp_path):
    """Every video limit (bytes, duration, frames, pixels) and a damaged or foreign container is a FieldError naming
    the part and the limit, without the decoder's internals; a good video still works after them. A file:// path is
    read only inside the operator's allowed folder."""
    def refused(chat_content, fragment, stage=None):
        with pytest.raises(FieldError, match=fragment) as error:
            (stage or ours[0]).run({"text_input": string_tensor(json.dumps([{"role": "user",
                                                                              "content": chat_content}])),
                                    "max_tokens": np.array([2], dtype=np.int32)})
        assert error.value.field == "text_input[0].content[1]", error.value
        for internal in ("Traceback", "av.", "FFmpeg", "InvalidData"):
            assert internal not in str(error.value)

    good = video_bytes(clip_frames(), VIDEO_FPS)
    text = {"type": "text", "text": QUESTION}

    def limited(**limits):
        return Preprocessor.from_pretrained(folder, 2048, MediaConfig.from_parameters(
            {"llm_model_path": folder, **{k: str(v) for k, v in limits.items()}}),
            allowed_local_media_path=str(tmp_path / "allowed"))

    refused([text, video_part(good)], "larger than the limit of", limited(max_video_bytes=1000))
    refused([text, video_part(good)], "over the limit of 1.5 s", limited(max_video_seconds=1.5))
    refused([text, video_part(good)], "over the limit of 2 frames", limited(max_video_frames=2))
    refused([text, video_part(good)], "over the limit of 1000 pixels", limited(max_video_pixels=1000))
    mp4 = video_bytes(clip_frames(), VIDEO_FPS, container="mp4", codec="mpeg4")
    refused([text, video_part(mp4[:len(mp4) // 2], "video/mp4")], "unsupported or damaged video")  # index lost
    refused([text, video_part(b"\x00garbage" * 100)], "unsupported or damaged video")
    refused([text, video_part(audio_bytes(), "audio/wav")], "no video track")
    refused([text, video_part(video_bytes(clip_frames()[:1], VIDEO_FPS))], "needs at least 2")
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed" / "clip.mkv").write_bytes(good)
    (tmp_path / "outside.mkv").write_bytes(good)
    local = limited()
    refused([text, {"type": "video_url", "video_url": {"url": f"file://{tmp_path}/outside.mkv"}}],
            "outside the folder", local)
    refused([text, {"type": "video_url", "video_url": {"url": f"file://{tmp_path}/allowed/clip.mkv"}}],
            "local video files are disabled")
    inside = local.run({"text_input": string_tensor(json.dumps([{"role": "user", "content": [
        text, {"type": "video_url", "video_url": {"url": f"file://{tmp_path}/allowed/clip.mkv"}}]}])),
        "max_tokens": np.array([2], dtype=np.int32)})
    after = ours[0].run({"text_input": string_tensor(json.dumps(messages("video"))),
                         "max_tokens": np.array([2], dtype=np.int32)})
    assert inside["input_ids"].tolist() == after["input_ids"].tolist()


def test_a_model_whose_processor_reads_no_video_refuses_a_video_part(idefics3):
    stage = Preprocessor.from_pretrained(idefics3, 2048, MediaConfig.from_parameters({"llm_model_path": idefics3}))
    with pytest.raises(FieldError, match="no video encoder") as error:
        stage.run({"text_input": string_tensor(json.dumps(messages("video"))),
                   "max_tokens": np.array([2], dtype=np.int32)})
    assert error.value.field == "text_input[0].content[1]"
