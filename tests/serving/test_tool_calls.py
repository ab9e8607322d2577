"""Tool calling (serving/tools.py): tools and tool_choice checked and turned into a prompt input and a grammar,
answers parsed into OpenAI tool calls (non-streamed and streamed, assembled by the openai client's stream
helpers), and, through the real stack, `required` and named choices whose arguments always validate."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from helpers.front_door import MODEL

from omni_backend.serving import protocol
from omni_backend.serving.errors import OpenAIError
from omni_backend.serving.tools import ToolRequest, requested_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]


def _request(**fields) -> protocol.ChatCompletionRequest:
    return protocol.parse_request(protocol.ChatCompletionRequest, {"model": "m", "messages": ASK, **fields})


# --- checking and the grammar (no server) ---------------------------------------------------------------------

def test_tools_become_a_prompt_input_and_required_or_named_a_grammar():
    auto = _request(tools=TOOLS).generation()
    assert json.loads(auto.prompts[0].template["tools"]) == TOOLS and auto.guide is None
    assert auto.tools.choice == "auto"
    required = _request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).generation()
    schema = json.loads(required.guide.guide)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    jsonschema.validate([{"name": "get_time", "arguments": {"city": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {}}], schema)
    named = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}).generation()
    assert json.loads(named.guide.guide) == SCHEMAS["get_weather"] and named.guide.field == "tools"
    assert _request(tools=TOOLS, tool_choice="none").generation().guide is None


@pytest.mark.parametrize("fields, param, fragment", [
    ({"tools": [{"type": "function"}]}, "tools[0]", "must be {\"type\": \"function\""),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "1 to 64"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}]},
     "tools[0].function.parameters", "is not a valid JSON schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools (get_weather, get_time)"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be \"none\", \"auto\", \"required\""),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with response_format"),
    ({"functions": [WEATHER["function"]]}, "functions", "use tools"),
])
def test_bad_tools_are_a_400_naming_the_field(fields, param, fragment):
    with pytest.raises(OpenAIError) as caught:
        _request(**fields).check()
    assert (caught.value.status, caught.value.param) == (400, param) and fragment in caught.value.message


def test_tool_history_goes_to_preprocess_with_the_messages():
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Tokyo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "09:00"}]
    request = protocol.parse_request(protocol.ChatCompletionRequest, {"model": "m", "messages": history,
                                                                      "tools": TOOLS})
    request.check()
    sent = json.loads(request.generation().prompts[0].text)
    assert sent[1]["tool_calls"] == history[1]["tool_calls"] and sent[2]["tool_call_id"] == "call_1"


# --- parsing answers ------------------------------------------------------------------------------------------

def test_hermes_blocks_naming_given_tools_become_calls_and_the_rest_stays_content():
    tools = requested_tools(TOOLS, "auto", None)
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"city": "Tokyo"}}</tool_call>')
    content, calls = tools.calls(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"city": "Tokyo"})]
    assert content == 'Let me check.\n\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert tools.calls("Just text.") == ("Just text.", [])
    odd = '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>'  # a model's output, not a client fault
    assert tools.calls(odd) == (odd, [])


def test_required_and_named_answers_and_answers_cut_short():
    required = ToolRequest(tuple(TOOLS), "required", None, True)
    content, calls = required.calls('[{"name": "get_time", "arguments": {"city": "Oslo"}}]')
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_time", '{"city": "Oslo"}')]
    assert required.calls('[{"name": "get_time", "argu') == ('[{"name": "get_time", "argu', [])
    named = ToolRequest(tuple(TOOLS), "named", "get_time", True)
    assert named.calls('{"city": "Oslo"}')[1][0]["function"] == {"name": "get_time", "arguments": '{"city": "Oslo"}'}


# --- through the stack --------------------------------------------------------------------------------------

@pytest.mark.server
def test_required_tool_calls_are_valid_greedy_and_sampled(openai_client):
    # one call each: with parallel calls allowed SmolLM2-135M writes the two right calls, then repeats them until
    # max_tokens (an answer cut short is text with finish_reason "length")
    for temperature, seed in ((0, None), (0.9, 1), (0.9, 2), (0.9, 3)):
        answer = openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                       parallel_tool_calls=False, max_tokens=200,
                                                       temperature=temperature, seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.server
def test_named_tool_call_and_streamed_calls_assemble_to_the_same_answer(openai_client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                                  max_tokens=120, temperature=0)
    call, = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and whole.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    with openai_client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                                    max_tokens=120, temperature=0) as stream:
        final = stream.get_final_completion()
    streamed, = final.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"


@pytest.mark.server
def test_a_tool_history_is_answered_and_bad_tools_are_a_400(openai_client):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Tokyo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "It is 09:00 in Tokyo."}]
    answer = openai_client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                                   max_tokens=16, temperature=0)
    assert answer.choices[0].message.content and answer.usage.prompt_tokens > 100  # the tools are in the prompt
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8,
                                              tool_choice={"type": "function", "function": {"name": "nope"}})
    assert caught.value.body["param"] == "tool_choice"
