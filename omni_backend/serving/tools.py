"""Tool calling at the front door: `tools`, `tool_choice` and `parallel_tool_calls` in, `message.tool_calls` out.

As vLLM's OpenAI server does it (its tool parsers and `tool_choice` handling, read for the design):

- The tool definitions go to preprocess (its `tools` input), which shows them to the model through the chat
  template, or in the default Hermes-style rendering when the template has no tool support
  (stages/tool_prompt.py). Assistant `tool_calls` and `tool` messages in the history go the same way.
- `tool_choice: "required"` and a named function are constrained (engine/structured_output.py): `required` to a
  JSON array of `{"name": <one of the tools>, "arguments": <its parameters' schema>}` (exactly one call when
  `parallel_tool_calls` is false), a named function to its parameters' schema (the answer is the arguments). So
  the arguments always validate against the function's schema.
- `auto` (the default with tools) is free text, parsed Hermes-style: each `<tool_call>{"name", "arguments"}
  </tool_call>` block naming a given tool becomes a call, the rest of the text is the content (vLLM's `hermes`
  parser's format, which Qwen2/Qwen2.5 and the default rendering use). It is constrained once the model opens a
  call, as vLLM does for hermes with xgrammar's structural tags: free text until `<tool_call>`, then
  `\n{"name": "<a given function>", "arguments": <its parameters' schema>}\n</tool_call>` (guide type
  `structural_tag`). With `response_format` or `structured_outputs` that grammar constrains the answer instead.
- `none` shows the tools and leaves the answer as text.

An answer with calls has `finish_reason: "tool_calls"`; streamed, its calls come as incremental `delta.tool_calls`
(serving/tool_parser.py), which the openai client's stream helpers assemble as they do OpenAI's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from omni_backend.serving.errors import invalid
from omni_backend.serving.structured import Guide
from omni_backend.serving.tool_parser import CLOSE, TRIGGER, ToolCallParser

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools, checked.

    Attributes:
        tools: the definitions as given (OpenAI shape).
        choice: "none", "auto", "required" or "named".
        name: the named function (choice "named"), else None.
        parallel: more than one call allowed (`parallel_tool_calls`, default true).
    """

    tools: tuple[dict, ...]
    choice: str
    name: str | None
    parallel: bool

    @property
    def parameters(self) -> dict[str, dict]:
        """Function name -> its parameters' JSON schema (any object where none is given)."""
        return {t["function"]["name"]: t["function"].get("parameters") or ANY_OBJECT for t in self.tools}

    @property
    def parses(self) -> bool:
        """The answer may hold tool calls (every choice but "none")."""
        return self.choice != "none"

    def prompt_tools(self) -> str:
        """preprocess's `tools` input: the definitions as a JSON array."""
        return json.dumps(list(self.tools), ensure_ascii=False)

    def guide(self) -> Guide | None:
        """The grammar of a `required`, named or `auto` choice (module docstring), None for `none`."""
        if self.choice == "named":
            return Guide("json_schema", json.dumps(self.parameters[self.name]), "tools")
        if self.choice == "auto":
            return Guide("structural_tag", json.dumps(self._hermes_tag()), "tools")
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "arguments": schema},
                  "required": ["name", "arguments"]} for name, schema in self.parameters.items()]
        array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return Guide("json_schema", json.dumps(array), "tools")

    def _hermes_tag(self) -> dict:
        """xgrammar's structural tag of Hermes calls: free text until `<tool_call>`, then a given function's head
        and arguments (its parameters' schema) up to `</tool_call>`; at most one call without parallel calls.
        Within the arguments at most one whitespace character in a row: a small model could otherwise write
        whitespace until max_tokens."""
        tags = [{"type": "tag", "begin": f'{TRIGGER}\n{{"name": "{name}", "arguments": ',
                 "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
                 "end": f"}}\n{CLOSE}"} for name, schema in self.parameters.items()]
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [TRIGGER], "tags": tags,
                                                     "stop_after_first": not self.parallel}}

    def parser(self) -> ToolCallParser:
        """A parser of one answer's text into content and calls (serving/tool_parser.py), fed as it streams."""
        return ToolCallParser(self.choice, self.parameters, self.name)

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole answer's (content or None, tool calls in OpenAI's shape), as its stream assembles them."""
        return ToolCallParser.parse(self.choice, self.parameters, self.name, text)


def requested_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """The checked tools of a chat request, None without tools (tool_choice then absent, "none" or "auto").

    Raises:
        OpenAIError: 400 naming the field: a tool of the wrong shape, a name twice, parameters that are not a
            valid JSON schema, a tool_choice that is not none/auto/required/a function of `tools`.
    """
    if not tools:
        if tool_choice not in (None, "none", "auto"):  # auto without tools: nothing to call
            raise invalid(f"tool_choice {json.dumps(tool_choice)} needs tools", "tool_choice")
        return None
    names = []
    for i, tool in enumerate(tools):
        _check_tool(tool, f"tools[{i}]")
        name = tool["function"]["name"]
        if name in names:
            raise invalid(f"tools[{i}].function.name '{name}' is given twice", f"tools[{i}].function.name")
        names.append(name)
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return ToolRequest(tuple(tools), tool_choice or "auto", None, parallel)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(function, dict):
        raise invalid("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                      "\"function\": {\"name\": ...}}", "tool_choice")
    if function.get("name") not in names:
        raise invalid(f"tool_choice names the function {function.get('name')!r}, which is not in tools "
                      f"({', '.join(names)})", "tool_choice")
    return ToolRequest(tuple(tools), "named", function["name"], parallel)


def check_tool_calls(calls: list, where: str) -> None:
    """An assistant message's `tool_calls` (`where`: "messages[i].tool_calls").

    Raises:
        OpenAIError: 400 naming the call whose shape is not {"id", "type": "function", "function": {"name",
            "arguments" (a JSON object as a string)}}.
    """
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        try:
            shaped = isinstance(call.get("id"), str) and call.get("type") == "function" \
                and isinstance(function.get("name"), str) and isinstance(json.loads(arguments), dict)
        except (AttributeError, TypeError, json.JSONDecodeError):
            shaped = False
        if not shaped:
            raise invalid(f"{where}[{i}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                          "\"arguments\": a JSON object as a string}}}}", f"{where}[{i}]")


def _check_tool(tool: Any, where: str) -> None:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise invalid(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"description\", "
                      "\"parameters\"}}}}", where)
    function = tool["function"]
    if not isinstance(function.get("name"), str) or not _NAME.match(function["name"]):
        raise invalid(f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes",
                      f"{where}.function.name")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise invalid(f"{where}.function.description must be a string", f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        return
    if not isinstance(parameters, dict):
        raise invalid(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as exc:
        at = "/".join(str(p) for p in exc.path) or "its top level"
        raise invalid(f"{where}.function.parameters is not a valid JSON schema: at {at}: {exc.message}",
                      f"{where}.function.parameters") from None
