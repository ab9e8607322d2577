"""Tool calling (serving/tools.py, serving/tool_parser.py): tools and tool_choice checked and turned into a prompt
input and a grammar, answers parsed into OpenAI tool calls, streamed as incremental deltas that assemble to the
non-streamed answer however the text is cut, and, through the real stack, `required` and named choices whose
arguments always validate and streamed calls that the openai client's stream helpers assemble to the non-streamed
answer (required and named through the server; auto from the front door's event stream)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from helpers.front_door import MODEL
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from omni_backend.engine.structured_output import check_guide
from omni_backend.serving import protocol
from omni_backend.serving.errors import OpenAIError
from omni_backend.serving.generation import Choice, Generation
from omni_backend.serving.pipeline import Prepared, Step
from omni_backend.serving.responses import chat_message, stream_events
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
    assert json.loads(auto.prompts[0].template["tools"]) == TOOLS and auto.tools.choice == "auto"
    tag = json.loads(auto.guide.guide)  # auto: free text, each call once opened its function's schema
    assert auto.guide.guide_type == "structural_tag" and tag["format"]["triggers"] == ["<tool_call>"]
    assert [(t["begin"], t["content"]["json_schema"], t["end"]) for t in tag["format"]["tags"]] == [
        (f'<tool_call>\n{{"name": "{name}", "arguments": ', schema, "}\n</tool_call>") for name, schema in SCHEMAS.items()]
    check_guide(auto.guide.guide_type, auto.guide.guide)
    assert _request(tools=TOOLS, response_format={"type": "json_object"}).generation().guide.guide_type == "json"
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
            '<tool_call>{"name": "get_time", "arguments": {"city": "To}kyo \\"x\\""}}</tool_call>')
    content, calls = tools.calls(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"city": "To}kyo \\"x\\""}')]
    # the whitespace before a call between two texts keeps them apart; around the last call it is dropped
    assert content == 'Let me check.\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert tools.calls("Just text. <tool is a < sign  \n") == ("Just text. <tool is a < sign  \n", [])
    odd = '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>'  # a model's output, not a client fault
    assert tools.calls(odd) == (odd, [])
    assert tools.calls('Hi <tool_call>{"name": "get_time", "arguments": {}}</tool_call>  there')[0] == "Hi there"


def test_required_and_named_answers_and_answers_cut_short():
    required = ToolRequest(tuple(TOOLS), "required", None, True)
    content, calls = required.calls('[{"name": "get_time", "arguments": {"city": "Oslo"}}, '
                                    '{"name": "get_weather", "arguments": {"city": "Rome]", "unit": "celsius"}}]')
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_time", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome]", "unit": "celsius"}')]
    # cut by max_tokens: before the first call's arguments, the text; within them, the call as far as it got
    assert required.calls('[{"name": "get_time", "argu') == ('[{"name": "get_time", "argu', [])
    assert [c["function"] for c in required.calls('[{"name": "get_time", "arguments": {"ci')[1]] == [
        {"name": "get_time", "arguments": '{"ci'}]
    named = ToolRequest(tuple(TOOLS), "named", "get_time", True)
    assert named.calls('{"city": "Oslo"}')[1][0]["function"] == {"name": "get_time", "arguments": '{"city": "Oslo"}'}


def _assembled(parser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Content and (name, arguments) of the calls as a client assembles the streamed deltas."""
    content, calls = "", {}
    for delta_content, deltas in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += delta_content
        for delta in deltas:
            if "id" in delta:
                assert delta["type"] == "function" and delta["index"] == len(calls)
                calls[delta["index"]] = [delta["function"]["name"], ""]
            calls[delta["index"]][1] += delta["function"]["arguments"]
    return content or None, [tuple(call) for call in calls.values()]


@pytest.mark.parametrize("choice, text, names", [
    ("auto", (' Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "[To{kyo\\\\"}}\n</tool_call>'),
     ["get_weather", "get_time"]),
    ("auto", 'No call: <tool_calls> <tool_call>{"name": "nope", "arguments": {}}</tool_call> <tool_c', []),
    ("auto", 'Cut: <tool_call>\n{"name": "get_time", "arguments": {"city": "Os', ["get_time"]),
    ("required", ('[{"name": "get_time", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": '
                  '{"city": "A\\"]}", "unit": "fahrenheit"}}]'), ["get_time", "get_weather"]),
    ("required", '[{"name": "get_time", "argu', []),
    ("named", '{"city": "Oslo", "unit": "celsius"}', ["get_weather"]),
])
def test_streamed_deltas_assemble_to_the_whole_answer_however_the_text_is_cut(choice, text, names):
    tools = ToolRequest(tuple(TOOLS), choice, "get_weather" if choice == "named" else None, True)
    content, calls = tools.calls(text)
    whole = (content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    assert [name for name, _ in whole[1]] == names
    assert _assembled(tools.parser(), [text]) == whole
    for size in (1, 2, 3, 7):
        assert _assembled(tools.parser(), [text[i:i + size] for i in range(0, len(text), size)]) == whole, size


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_the_openai_clients_stream_state_assembles_the_front_doors_chunks_to_the_message(choice):
    # the test server's model (a tiny SmolVLM) does not call tools by itself in `auto`: its chunks are checked here,
    # from the front door's event stream over the steps of an answer that does
    text = {"auto": 'Let me see. <tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>',
            "required": '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]'}[choice]
    request = _request(tools=TOOLS, tool_choice=choice).generation()
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]

    async def steps():
        for i, piece in enumerate(pieces):
            yield Step(piece, "stop" if i == len(pieces) - 1 else None, 40, i + 1, None)

    async def events() -> list[str]:
        generation = Generation(None, request, "chatcmpl-1")
        generation.choices = [Choice(0, Prepared({}, 40, ""), steps(), prompt_only=False)]
        await generation.choices[0].start()
        return [event.data async for event in stream_events(request, generation, "chatcmpl-1")]

    data = asyncio.run(events())
    assert data[-1] == "[DONE]"
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for item in data[:-1]:
        state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(item)))
    final = state.get_final_completion().choices[0]
    message, finish_reason = chat_message(request, text, "stop")
    assert final.finish_reason == finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert (final.message.content or None) == message["content"] == ("Let me see." if choice == "auto" else None)
    tool_deltas = [json.loads(item)["choices"][0]["delta"].get("tool_calls") for item in data[1:-1]]
    assert sum(1 for d in tool_deltas if d) > 3  # a head, then fragments: not one whole call at the end


def test_a_call_goes_out_as_its_head_then_argument_fragments():
    parser = ToolRequest(tuple(TOOLS), "auto", None, True).parser()
    assert parser.feed("Checking <tool_") == ("Checking", [])  # a possible start of a call is held back
    assert parser.feed('call>{"name": "get_time", ') == ("", [])
    content, (head,) = parser.feed('"arguments": {"ci')
    assert content == "" and head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_time", "arguments": '{"ci'}
    assert parser.feed('ty": "Oslo"}}</tool_call>') == ("", [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}])
    assert parser.finish() == ("", [])


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
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_streamed_calls_assemble_to_the_non_streamed_answer(openai_client, tool_choice):
    fields = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice,
              "parallel_tool_calls": False, "max_tokens": 120, "temperature": 0}
    whole = openai_client.chat.completions.create(**fields)
    assert whole.choices[0].finish_reason == "tool_calls", whole.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert calls and all(jsonschema.validate(json.loads(a), SCHEMAS[n]) is None for n, a in calls)
    with openai_client.chat.completions.stream(**fields) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert (final.choices[0].message.content or None) == whole.choices[0].message.content  # the first delta: ""
    # incremental: the call's head, then its arguments in more than one fragment
    fragments = [call.function.arguments for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert len(fragments) > 2 and fragments[0] is not None
    assert "".join(f or "" for f in fragments) == calls[0][1]


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
