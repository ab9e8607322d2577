"""Input addends (`sequence.InputAddends`): rows added to a sequence's generated tokens' input embeddings as they
arrive from another stage (Qwen2.5-Omni's talker takes its thinker's reply this way; the talker itself is tested
against transformers in tests/multimodal/test_qwen2_5_omni_speech.py). Here on the tiny Qwen2, through the engine
loop's messages: a request whose next row has not come waits and the others go on."""

from __future__ import annotations

import pytest
import torch

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine, RequestOutput
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import InputAddends
from omni_backend.stages.llm.core import EngineCore
from omni_backend.stages.llm.messages import AddRequest, ExtendInputs
from omni_backend.vocabulary import ErrorKind, StageError

PROMPT = [4, 5, 6, 7]
NEW_TOKENS = 8


def test_rows_come_in_order_and_the_tail_repeats_its_last_row():
    addends = InputAddends(2)
    assert not addends.ready(0)
    addends.extend(torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    addends.extend(torch.tensor([[3.0, 3.0]], dtype=torch.float16))
    assert addends.ready(2) and not addends.ready(3)
    assert addends.rows(1, 3).tolist() == [[2.0, 2.0], [3.0, 3.0]]
    addends.finish(torch.tensor([[8.0, 8.0], [9.0, 9.0]]))
    assert addends.ready(1000)
    assert addends.rows(2, 7)[:, 0].tolist() == [3.0, 8.0, 9.0, 9.0, 9.0]
    with pytest.raises(ValueError, match="finished"):
        addends.extend(torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"\[k, 2\]"):
        InputAddends(2).extend(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"m >= 1"):
        InputAddends(2).finish(torch.zeros(0, 2))


def reference_tokens(model_path: str, rows: torch.Tensor) -> list[int]:
    """transformers' greedy tokens for PROMPT when generated token j is fed back as its embedding + rows[j]
    (recomputing the whole sequence each step: plain, slow and obviously right)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tokens = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            embeds = model.get_input_embeddings()(torch.tensor([tokens]))
            generated = len(tokens) - len(PROMPT)
            embeds[0, len(PROMPT):] += rows[:generated]
            tokens.append(int(model(inputs_embeds=embeds).logits[0, -1].argmax()))
    return tokens[len(PROMPT):]


def outputs_of(core: EngineCore) -> dict[str, list]:
    found: dict[str, list] = {}
    while not core.outbox.empty():
        request_id, item = core.outbox.get()
        found.setdefault(request_id, []).append(item)
    return found


def tokens(items: list) -> list[int]:
    return [t for item in items if isinstance(item, RequestOutput) for t in item.token_ids]


def test_a_request_waits_for_its_rows_without_holding_back_others_and_equals_transformers(tiny_qwen2_path):
    """Request "a" takes its rows in two messages, the second with the tail; it waits twice (the engine loop finds
    nothing to run) while request "b" decodes; its tokens are transformers' with the same rows added."""
    engine = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=64,
                                    max_num_seqs=4, max_model_len=128))
    core = EngineCore(engine)  # not started: the test drives the loop with run_once
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, stream=True)
    rows = torch.randn(5, engine.hidden_size, generator=torch.Generator().manual_seed(0))
    core.put(AddRequest(engine.make_sequence("a", PROMPT, params, input_addends=InputAddends(engine.hidden_size))))
    core.put(AddRequest(engine.make_sequence("b", [9, 10, 11], params)))
    for _ in range(NEW_TOKENS):
        core.run_once()
    a = engine.requests["a"].seq
    assert a.num_output_tokens == 1  # sampled from the prompt; the next step needs row 0
    assert tokens(outputs_of(core)["b"]) and "b" not in engine.requests  # b ran all its steps meanwhile
    core.run_once()
    assert engine.stalled and a.num_output_tokens == 1
    core.put(ExtendInputs("a", rows[:3]))
    for _ in range(4):
        core.run_once()
    assert a.num_output_tokens == 4 and engine.stalled  # rows 0-2 fed tokens 1-3; token 4 waits again
    core.put(ExtendInputs("a", None, tail=rows[3:5]))
    while engine.has_unfinished():
        core.run_once()
    seen = outputs_of(core)["a"]
    assert seen[-1].finish_reason == "length"
    used = torch.cat([rows, rows[4:].expand(NEW_TOKENS - 1 - 5, -1)])  # the tail's last row repeats
    expected = reference_tokens(tiny_qwen2_path, used)
    assert tokens(seen) == expected
    assert expected != reference_tokens(tiny_qwen2_path, torch.zeros_like(used))  # the rows do change the answer
    assert engine.runner.block_manager.num_free_blocks == 64


def test_rows_of_the_wrong_width_end_that_request_alone(tiny_qwen2_path):
    engine = LLMEngine(EngineConfig(model_path=tiny_qwen2_path, dtype="float32", num_kv_blocks=64,
                                    max_num_seqs=4, max_model_len=128))
    width = engine.hidden_size
    with pytest.raises(ValueError, match=f"must be {width} wide"):
        engine.make_sequence("x", PROMPT, SamplingParams(max_tokens=2), input_addends=InputAddends(width + 1))
    core = EngineCore(engine)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    core.put(AddRequest(engine.make_sequence("a", PROMPT, params, input_addends=InputAddends(width))))
    core.put(AddRequest(engine.make_sequence("b", PROMPT, params, input_addends=InputAddends(width))))
    core.run_once()
    core.put(ExtendInputs("a", torch.zeros(2, width + 1)))
    core.put(ExtendInputs("b", None, tail=torch.zeros(1, width)))
    while engine.has_unfinished():
        core.run_once()
    seen = outputs_of(core)
    error = seen["a"][-1]
    assert isinstance(error, StageError) and error.kind == ErrorKind.INVALID_ARGUMENT
    assert f"[k, {width}]" in str(error)
    assert len(seen["b"][-1].token_ids) == 4 and seen["b"][-1].finish_reason == "length"
    assert engine.runner.block_manager.num_free_blocks == 64
