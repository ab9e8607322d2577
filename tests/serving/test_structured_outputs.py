"""Structured outputs through the front door and Triton: response_format (json_object, json_schema) and vLLM's
structured_outputs (json, regex, choice, grammar) on chat and completions, the TensorRT-LLM guided_decoding inputs
on omni_chat through tritonclient, and bad input as a 400 naming the field (the next request still works)."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import jsonschema
import openai
import pytest
from helpers.chat_client import chat_messages, stream_infer
from helpers.front_door import MODEL

from omni_backend.ops.metrics import parse_metrics
from omni_backend.serving import protocol
from omni_backend.serving.errors import OpenAIError, invalid
from omni_backend.serving.structured import Guide, requested_guide

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 1, "maxItems": 2},
        "size": {"enum": ["small", "medium", "large"]},
    },
    "required": ["city", "country", "population", "facts", "size"],
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
ASK = [{"role": "user", "content": "Tell me about Paris as JSON."}]


# --- request fields -> the guide (no server) --------------------------------------------------------------

@pytest.mark.parametrize("response_format, structured_outputs, expected", [
    ({"type": "text"}, None, None),
    ({"type": "json_object"}, None, Guide("json", None, "response_format")),
    (JSON_SCHEMA, None, Guide("json_schema", json.dumps(CITY), "response_format.json_schema.schema")),
    (None, {"json": CITY}, Guide("json_schema", json.dumps(CITY), "structured_outputs.json")),
    (None, {"json": json.dumps(CITY)}, Guide("json_schema", json.dumps(CITY), "structured_outputs.json")),
    (None, {"regex": "[0-9]+"}, Guide("regex", "[0-9]+", "structured_outputs.regex")),
    (None, {"choice": ['say "yes"', "no"]}, Guide("ebnf_grammar", 'root ::= "say \\"yes\\"" | "no"',
                                                   "structured_outputs.choice")),
    (None, {"grammar": 'root ::= "a"'}, Guide("ebnf_grammar", 'root ::= "a"', "structured_outputs.grammar")),
    (None, {"json_object": True, "regex": None}, Guide("json", None, "structured_outputs.json_object")),
])
def test_request_fields_become_the_guide(response_format, structured_outputs, expected):
    assert requested_guide(response_format, structured_outputs) == expected


@pytest.mark.parametrize("response_format, structured_outputs, param, fragment", [
    ({"type": "xml"}, None, "response_format.type", "must be one of text, json_object, json_schema"),
    ({"type": "json_schema"}, None, "response_format.json_schema", "must be an object with 'name' and 'schema'"),
    ({"type": "json_schema", "json_schema": {"schema": CITY}}, None, "response_format.json_schema.name", "1 to 64"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": CITY}}, None,
     "response_format.json_schema.name", "letters, digits"),
    ({"type": "json_schema", "json_schema": {"name": "c", "schema": [1]}}, None,
     "response_format.json_schema.schema", "must be a JSON schema object"),
    ({"type": "json_object"}, {"regex": "a"}, "structured_outputs", "either response_format or structured_outputs"),
    (None, {"regex": "a", "choice": ["b"]}, "structured_outputs", "exactly one of json, regex, choice, grammar, "
     "json_object, got regex, choice"),
    (None, {}, "structured_outputs", "got none"),
    (None, {"choice": []}, "structured_outputs.choice", "non-empty list of non-empty strings"),
    (None, {"json": "{not json"}, "structured_outputs.json", "is not valid JSON"),
    (None, {"regex": 5}, "structured_outputs.regex", "must be a non-empty string"),
])
def test_malformed_fields_are_a_400_naming_them(response_format, structured_outputs, param, fragment):
    with pytest.raises(OpenAIError) as caught:
        requested_guide(response_format, structured_outputs)
    assert (caught.value.status, caught.value.param) == (400, param) and fragment in caught.value.message


def test_stage_errors_about_the_guide_name_the_clients_field():
    guide = Guide("regex", "(a", "structured_outputs.regex")
    renamed = guide.rename(invalid("response_format cannot be used as a regex guide: bad", "response_format"))
    assert (renamed.param, renamed.message) == ("structured_outputs.regex",
                                                "structured_outputs.regex cannot be used as a regex guide: bad")
    other = invalid("temperature must be ...", "temperature")
    assert guide.rename(other) is other


def test_completions_take_response_format_too():
    request = protocol.parse_request(protocol.CompletionRequest, {"model": "m", "prompt": "hi",
                                                                  "response_format": {"type": "json_object"}})
    generation = request.generation()
    assert generation.choice_settings(0)["guide_type"] == "json"


# --- through the stack --------------------------------------------------------------------------------------

@pytest.mark.server
def test_json_schema_chat_answers_validate_greedy_and_sampled_and_stream_the_same(openai_client):
    for temperature, seed in ((0, None), (0.8, 1), (0.8, 2)):
        answer = openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=160,
                                                       temperature=temperature, seed=seed,
                                                       response_format=JSON_SCHEMA)
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), CITY)
    greedy = openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=160, temperature=0,
                                                   response_format=JSON_SCHEMA)
    stream = openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=160, temperature=0,
                                                   response_format=JSON_SCHEMA, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == greedy.choices[0].message.content


@pytest.mark.server
def test_structured_outputs_regex_choice_grammar_and_json_object(openai_client):
    def ask(extra, max_tokens=24, **kwargs):
        return openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=max_tokens,
                                                     temperature=0, extra_body=extra, **kwargs).choices[0]

    assert re.fullmatch(r"[A-Z][a-z]+, [0-9]{4}", ask({"structured_outputs": {"regex": r"[A-Z][a-z]+, [0-9]{4}"}})
                        .message.content)
    assert ask({"structured_outputs": {"choice": ["France", "Spain"]}}).message.content in ("France", "Spain")
    assert ask({"structured_outputs": {"grammar": 'root ::= "It is " ("big" | "small")'}}).message.content in (
        "It is big", "It is small")
    # an object without a schema may go on past max_tokens (SmolLM2 lists facts): a finished one parses
    obj = ask({}, max_tokens=120, response_format={"type": "json_object"})
    assert obj.message.content.startswith("{") and obj.finish_reason in ("stop", "length")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)
    n2 = openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0.9, n=2,
                                               extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert all(c.message.content in ("yes", "no") for c in n2.choices)


@pytest.mark.server
def test_completions_with_a_schema_and_a_regex_that_cannot_finish(openai_client):
    answer = openai_client.completions.create(model=MODEL, prompt="Paris facts in JSON:", max_tokens=160,
                                              temperature=0, extra_body={"response_format": JSON_SCHEMA})
    jsonschema.validate(json.loads(answer.choices[0].text), CITY)
    cut = openai_client.completions.create(model=MODEL, prompt="Letters:", max_tokens=4, temperature=0,
                                           extra_body={"structured_outputs": {"regex": "a{40}"}})
    assert cut.choices[0].finish_reason == "length" and set(cut.choices[0].text) == {"a"}


@pytest.mark.server
@pytest.mark.parametrize("extra, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}},
     "response_format.json_schema.schema", "is not a valid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/no"}}}},
     "response_format.json_schema.schema", "cannot be used as a json_schema guide"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "Regex parsing error"),
    ({"structured_outputs": {"grammar": "root ::= b"}}, "structured_outputs.grammar", 'Rule "b" is not defined'),
    ({"structured_outputs": {"regex": "a" * 70000}}, "structured_outputs.regex", "is too large: 70000 characters"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be one of"),
])
def test_bad_guides_are_a_400_naming_the_field_and_the_next_request_works(openai_client, extra, param, fragment):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, extra_body=extra)
    error = caught.value.body
    assert error["param"] == param and fragment in error["message"] and error["message"].startswith(param)
    ok = openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def _llm_metric(server, name: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        samples = parse_metrics(response.read().decode())
    return sum(value for labels, value in samples.get(name, []) if labels.get("model") == "llm")


@pytest.mark.server
def test_guided_decoding_inputs_on_omni_chat_through_tritonclient(triton_server):
    before = {name: _llm_metric(triton_server, name) for name in (
        "omni_structured_requests_total", "omni_grammar_cache_hits_total", "omni_grammar_compile_seconds_count")}
    fresh = json.dumps({**CITY, "title": f"city-{time.time_ns()}"})  # never compiled in this server before
    result = stream_infer(triton_server.grpc_url, {
        "text_input": chat_messages("Tell me about Paris as JSON."), "max_tokens": 160, "temperature": 0.0,
        "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": fresh})
    assert result.error is None and result.last("finish_reason") == "stop"
    jsonschema.validate(json.loads(result.text), CITY)
    bad = stream_infer(triton_server.grpc_url, {
        "text_input": chat_messages("Hi"), "max_tokens": 4, "guided_decoding_guide_type": "regex",
        "guided_decoding_guide": "(ab"})
    assert bad.error is not None and "guided_decoding_guide cannot be used as a regex guide" in bad.error
    again = stream_infer(triton_server.grpc_url, {  # the same schema: a cache hit
        "text_input": chat_messages("And Rome?"), "max_tokens": 4, "guided_decoding_guide_type": "json_schema",
        "guided_decoding_guide": fresh})
    assert again.error is None
    # The llm stage publishes its metrics about once a second (the bad regex never reached it: preprocess refused
    # it), and `before` may predate an earlier test's last publication, so every counter is polled for its own
    # increase: two requests, the second one's cache hit, one compile.
    want = {"omni_structured_requests_total": 2, "omni_grammar_cache_hits_total": 1,
            "omni_grammar_compile_seconds_count": 1}
    deadline = time.monotonic() + 15
    while (short := [name for name, n in want.items() if _llm_metric(triton_server, name) < before[name] + n]):
        assert time.monotonic() < deadline, f"{short} did not count the requests"
        time.sleep(0.2)
