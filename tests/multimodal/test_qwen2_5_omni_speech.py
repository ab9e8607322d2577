"""Qwen2.5-Omni speaking with its own voice (issue 27), against transformers on the tiny checkpoint (float32): the
thinker's hidden states and input embeddings for the talker, the talker's codec ids, code2wav's waveform."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omni_reference import messages, transformers_inputs, transformers_reference
from test_qwen2_5_omni import engine_request, make_engine, prepare

from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.setup.tiny_hf_multimodal import build
from omni_backend.stages.media_encoder import create_stage
from omni_backend.stages.preprocess import Preprocessor
from omni_backend.stages.preprocess_media import MediaConfig

REPLY = 24  # thinker tokens per answer (enough to outgrow the tight KV cache below)
HIDDEN_TOLERANCE = 1e-5  # float32, absolute, on rows of magnitude up to ~3.5 (seen: 8.3e-7 at most)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build("qwen2_5_omni", tmp_path_factory.mktemp("omni-speech") / "checkpoint", log=lambda _: None))


@pytest.fixture(scope="module")
def reference(folder):
    return transformers_reference(folder)


@pytest.fixture(scope="module")
def ours(folder):
    stage = Preprocessor.from_pretrained(folder, 2048, MediaConfig.from_parameters({"llm_model_path": folder}))
    return stage, {kind: create_stage(kind, {"llm_model_path": folder}) for kind in ("image", "audio")}


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
