"""Grammar-constrained decoding (engine/structured_output.py) with the real SmolLM2: the bitmask touches only the
constrained rows, unconstrained requests keep their exact greedy tokens beside constrained ones, nested JSON schema
outputs parse and validate (jsonschema), regex/EBNF outputs match, a request waits for its grammar without holding
up the others, `auto` tool calls are constrained once the model opens one (structural tag), and bad guides end their
request with an error naming the guide."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import pytest
import torch
from helpers.chat_prompt import chat_ids, tool_chat_ids

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.engine.sampling_params import MAX_GUIDE_CHARS, InvalidSamplingParam, SamplingParams
from omni_backend.engine.structured_output import GrammarCompiler, apply_grammar_bitmask, check_guide, matcher
from omni_backend.serving.tools import requested_tools
from omni_backend.stages.llm.core import EngineCore
from omni_backend.stages.llm.messages import AddRequest
from omni_backend.vocabulary import ErrorKind, StageError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]
PROMPTS = ["Describe a person as JSON.", "Give me a user record.", "Who lives in Paris? Answer in JSON.",
           "Make up an administrator.", "A guest named Bob.", "Invent someone aged 42."]


@pytest.fixture(scope="module")
def engine(smollm2_path) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=smollm2_path, dtype="float32", kv_cache_bytes=64 << 20,
                                  max_num_seqs=8, max_model_len=512))


def _chat(engine, text):
    return chat_ids(engine.tokenizer, text)


def _schema_params(**overrides) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 160, "temperature": 0.0, "guide_type": "json_schema",
                             "guide": json.dumps(PERSON), **overrides})


# --- the bitmask ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_bitmask_masks_exactly_the_disallowed_tokens_of_constrained_rows_only(engine, device):
    compiled = engine.grammars.submit("regex", "(yes|no)").result()
    vocab = engine.grammars.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    before = logits.clone()
    apply_grammar_bitmask(logits, [None, matcher(compiled), None])
    assert logits.device.type == device
    logits, before = logits.cpu(), before.cpu()
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().squeeze(1).tolist()
    assert torch.equal(logits[1, allowed], before[1, allowed])
    texts = {engine.tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    assert {"y", "n"} <= {t[0] for t in texts}


# --- outputs --------------------------------------------------------------------------------------------------

def test_nested_schema_outputs_parse_and_validate_greedy_and_sampled(engine):
    prompts = [_chat(engine, p) for p in PROMPTS]
    params = [_schema_params()] * 3 + [_schema_params(temperature=0.8, top_p=0.95, seed=i) for i in range(3)]
    outputs = engine.generate(prompts, params)
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)


def test_unconstrained_requests_keep_their_exact_greedy_tokens_beside_constrained_ones(engine):
    free = [_chat(engine, "What is the capital of France?"), _chat(engine, "Count to five.")]
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    alone = [o.token_ids for o in engine.generate(free, plain)]
    mixed = engine.generate([free[0], _chat(engine, PROMPTS[0]), free[1], _chat(engine, PROMPTS[1])],
                            [plain, _schema_params(), plain, _schema_params(guide_type="json", guide=None)])
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].text), PERSON)
    assert isinstance(json.loads(mixed[3].text), dict)


def test_regex_and_ebnf_outputs_match_and_logprobs_are_those_of_the_masked_logits(engine):
    prompt = _chat(engine, "Is Paris in France?")
    regex, ebnf = engine.generate([prompt, prompt], [
        SamplingParams(max_tokens=16, temperature=0.0, guide_type="regex", guide=r"(Yes|No), [a-z]{2,8}\.",
                       logprobs=2),
        SamplingParams(max_tokens=16, temperature=0.0, guide_type="ebnf_grammar",
                       guide='root ::= "The answer is " ("yes" | "no")')])
    assert re.fullmatch(r"(Yes|No), [a-z]{2,8}\.", regex.text), regex.text
    assert ebnf.text in ("The answer is yes", "The answer is no")
    # logprobs are the masked distribution's: the comma after Yes/No is forced (probability 1), its runner-up -inf
    comma = regex.logprobs[1]
    assert engine.tokenizer.decode([comma.token_id]) == ","
    assert comma.logprob == pytest.approx(0.0, abs=1e-6) and comma.top[1][1] == float("-inf")


def test_a_grammar_that_cannot_finish_within_max_tokens_ends_with_length(engine):
    out, = engine.generate([_chat(engine, "Say a.")], SamplingParams(max_tokens=5, temperature=0.0,
                                                                      guide_type="regex", guide="a{50}"))
    assert out.finish_reason == "length" and out.text == "a" * len(out.text) and out.completion_tokens == 5


def test_stop_strings_apply_to_constrained_output(engine):
    out, = engine.generate([_chat(engine, PROMPTS[0])], _schema_params(stop=['"age"']))
    assert out.finish_reason == "stop" and out.text.startswith('{"name": "') and '"age"' not in out.text


def test_preempted_constrained_sequences_keep_their_matcher(smollm2_path, engine):
    prompts = [_chat(engine, p) for p in PROMPTS[:4]]
    roomy = engine.generate(prompts, _schema_params(max_tokens=96))
    tight = LLMEngine(EngineConfig(model_path=smollm2_path, dtype="float32", num_kv_blocks=24, block_size=16,
                                   max_model_len=256))
    squeezed = tight.generate(prompts, _schema_params(max_tokens=96))
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]


# get_weather wants `days`, which the call shown in the history lacks: SmolLM2-135M copies that call, and only the
# grammar makes it add `days`
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}


def _shown_a_call(city: str) -> list[dict]:
    return [{"role": "user", "content": "What is the weather in Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
            {"role": "user", "content": f"What is the weather in {city}?"}]


def test_auto_tool_calls_are_free_text_until_opened_then_follow_the_schema(engine):
    tools = requested_tools([WEATHER, TIME], "auto", False)
    guide = tools.guide()
    assert guide.guide_type == "structural_tag"
    prompts = [tool_chat_ids(engine.tokenizer, _shown_a_call(city), [WEATHER, TIME]) for city in ("Paris", "Oslo")]
    alone, = engine.generate(prompts[:1], SamplingParams(max_tokens=64, temperature=0.0))
    _, (call,) = tools.calls(alone.text)
    assert "days" not in json.loads(call["function"]["arguments"])  # unconstrained: the shown call's form
    params = [SamplingParams(max_tokens=64, temperature=0.0, guide_type=guide.guide_type, guide=guide.guide)] * 2 + [
        SamplingParams(max_tokens=64, temperature=1.0, seed=seed, guide_type=guide.guide_type, guide=guide.guide)
        for seed in range(2)]
    outputs = engine.generate(prompts * 2, params)
    for out in outputs:
        content, calls = tools.calls(out.text)
        assert out.finish_reason == "stop" and len(calls) == 1 and content is None, out.text
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]),
                            {"get_weather": WEATHER, "get_time": TIME}[calls[0]["function"]["name"]]
                            ["function"]["parameters"])
    # free text before a call stays free: a prompt that gets no call gets the model's own words
    chat, = engine.generate([_chat(engine, "Hello!")], [params[0]])
    assert chat.text == engine.generate([_chat(engine, "Hello!")], SamplingParams(max_tokens=64,
                                                                                   temperature=0.0))[0].text


# --- compiling ------------------------------------------------------------------------------------------------

def test_a_request_waits_for_its_grammar_while_the_others_step(engine, monkeypatch):
    pending: concurrent.futures.Future = concurrent.futures.Future()
    monkeypatch.setattr(engine.grammars, "submit", lambda guide_type, guide: pending)
    monkeypatch.setattr(engine.config, "grammar_compile_timeout_s", 600.0)  # a loaded machine's steps are slow
    engine.add_request("free", _chat(engine, "Hello!"), SamplingParams(max_tokens=6, temperature=0.0))
    engine.add_request("json", _chat(engine, PROMPTS[0]), _schema_params(max_tokens=48))
    finished = {}
    while "free" not in finished:
        for out in engine.step():
            finished[out.request_id] = out
    assert "json" in engine.awaiting_grammar and "json" not in finished
    engine.step()  # only the compile is left: not a stall (the engine loop would sleep its idle wait, not 5 ms)
    assert not engine.stalled
    monkeypatch.undo()
    pending.set_result(engine.grammars.submit("json_schema", json.dumps(PERSON)).result())
    while engine.has_unfinished():
        for out in engine.step():
            finished[out.request_id] = out
    assert finished["free"].completion_tokens == 6
    assert finished["json"].text.startswith('{"name": "')


def test_each_distinct_guide_compiles_once(smollm2_path, engine):
    compiler = GrammarCompiler(engine.tokenizer, engine.grammars.vocab_size, [2])
    compiler.ready.result(timeout=120)  # the vocabulary is read at construction, before any request asks
    assert compiler.num_requests == 0
    first = compiler.submit("regex", "[0-9]+")
    assert compiler.submit("regex", "[0-9]+") is first
    assert compiler.submit("json", "ignored") is compiler.submit("json", None)
    assert (compiler.num_requests, compiler.num_cache_hits) == (4, 2)
    first.result()
    assert len(compiler.take_compile_seconds()) >= 1 and compiler.take_compile_seconds() == []
    compiler.shutdown()


@pytest.mark.parametrize("guide_type,guide,problem", [
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "integr"}}}', "not a valid JSON schema"),
    ("json_schema", '{"type": ', "is not valid JSON"),
    ("json_schema", '[1, 2]', "must be a JSON schema"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "cannot be used as a json_schema guide"),
    ("regex", "(ab", "parenthesis is not closed"),
    ("ebnf_grammar", 'root ::= "a" | b', 'Rule "b" is not defined'),
])
def test_bad_guides_are_refused_naming_the_guide(engine, guide_type, guide, problem):
    with pytest.raises(InvalidSamplingParam, match=re.escape(problem)) as caught:
        check_guide(guide_type, guide)
    assert caught.value.field == "guide" and "/project/" not in str(caught.value)
    # the engine ends such a request alone, naming the guide, and the next request works
    engine.add_request("bad", _chat(engine, "Hi"), SamplingParams(max_tokens=4, guide_type=guide_type, guide=guide))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [(o.finish_reason, o.error_field) for o in outputs] == [("error", "guide")]
    assert problem in outputs[0].error
    ok, = engine.generate([_chat(engine, "Hi")], SamplingParams(max_tokens=4, temperature=0.0))
    assert ok.finish_reason in ("stop", "length")


def test_guide_settings_are_checked_naming_the_field():
    with pytest.raises(InvalidSamplingParam, match="guide_type must be one of json, json_schema, regex, ebnf_grammar"):
        SamplingParams(guide_type="xml", guide="<a/>")
    with pytest.raises(InvalidSamplingParam, match="guide must be a non-empty string for guide_type regex"):
        SamplingParams(guide_type="regex")
    with pytest.raises(InvalidSamplingParam, match="guide needs a guide_type"):
        SamplingParams(guide="[0-9]")
    with pytest.raises(InvalidSamplingParam, match=f"guide is too large: {MAX_GUIDE_CHARS + 1} characters"):
        SamplingParams(guide_type="regex", guide="a" * (MAX_GUIDE_CHARS + 1))


def test_a_compile_past_the_timeout_ends_the_request_naming_the_guide(engine, monkeypatch):
    monkeypatch.setattr(engine.grammars, "submit", lambda guide_type, guide: concurrent.futures.Future())
    monkeypatch.setattr(engine.config, "grammar_compile_timeout_s", 0.02)
    engine.add_request("slow", _chat(engine, "Hi"), _schema_params())
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [(o.finish_reason, o.error_field) for o in outputs] == [("error", "guide")]
    assert "did not compile within 0.02 s" in outputs[0].error


def test_the_engine_loop_answers_a_bad_guide_with_invalid_argument_naming_its_tensor(engine):
    core = EngineCore(engine)
    core.put(AddRequest(engine.make_sequence("bad", _chat(engine, "Hi"), SamplingParams(
        max_tokens=4, guide_type="json_schema", guide='{"$ref": "#/$defs/none"}'))))
    core.run_once()  # takes the request
    while engine.has_unfinished():
        core.run_once()
    request_id, error = core.outbox.get_nowait()
    assert request_id == "bad" and isinstance(error, StageError)
    assert (error.kind, error.field) == (ErrorKind.INVALID_ARGUMENT, "guided_decoding_guide")
    assert error.message.startswith("guided_decoding_guide cannot be used as a json_schema guide: ")
