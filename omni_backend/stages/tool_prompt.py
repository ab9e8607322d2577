"""Tools in a chat prompt: the tool definitions, assistant tool calls and tool results, for the chat template.

A chat template that reads `tools` (Qwen2.5's, Llama 3.1's, ...) renders them itself: `ChatTemplate.render` passes
the definitions as `tools=` and the messages as transformers' templates take them (an assistant message's
`tool_calls` with `function.arguments` as an object, a `tool` message with its `tool_call_id`).

A template that does not (SmolLM2's) gets the default rendering here, in the Hermes style that Qwen2.5 and
Hermes-2-Pro models are trained on (NousResearch's Hermes function-calling format):

- a system message (the client's first system message, if any, comes first in it) that lists the tools as JSON
  objects, one per line, between `<tools>` and `</tools>`, and asks for each call as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- an assistant message's tool calls appended to its content in that form;
- a `tool` message as a `user` message `<tool_response>...</tool_response>` (templates without tools know only
  the usual roles).

The front door parses answers in the same form (serving/tools.py). Every string the client wrote goes through
`as_text` (`ChatTemplate.mark`), so a control-token string in a tool's description or arguments stays text.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from omni_backend import tensor_names as T
from omni_backend.vocabulary import FieldError
_INSTRUCTIONS = (
    "You can call functions to help with the user's request. The functions you may call are described, one JSON "
    "object each, between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, write a JSON "
    "object with its name and arguments between <tool_call> and </tool_call>, for example:\n<tool_call>\n"
    "{{\"name\": \"<function name>\", \"arguments\": {{<arguments as a JSON object>}}}}\n</tool_call>")


def parse_tools(text: str | None) -> list[dict] | None:
    """The `tools` input (a JSON array of OpenAI tool definitions, checked by the front door) as a list.

    Raises:
        FieldError: not a JSON array of objects.
    """
    if text is None:
        return None
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FieldError(T.TOOLS, f"is not valid JSON: {exc.msg}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise FieldError(T.TOOLS, "must be a JSON array of tool objects")
    return tools


def tool_call_fields(message: dict, where: str, as_text: Callable[[str], str]) -> dict:
    """The tool fields of one client message, as transformers' templates take them: an assistant's `tool_calls`
    ([{"type": "function", "id", "function": {"name", "arguments": object}}]), a tool message's `tool_call_id`.

    Raises:
        FieldError: naming the message's field (`text_input[2].tool_calls[0].function.arguments`).
    """
    out: dict = {}
    if message.get("tool_call_id") is not None:
        if not isinstance(message["tool_call_id"], str):
            raise FieldError(f"{where}.tool_call_id", "must be a string")
        out["tool_call_id"] = as_text(message["tool_call_id"])
    calls = message.get("tool_calls")
    if calls is None:
        return out
    if not isinstance(calls, list):
        raise FieldError(f"{where}.tool_calls", "must be a list of tool calls")
    out["tool_calls"] = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise FieldError(f"{where}.tool_calls[{i}]", "must be {\"type\": \"function\", \"id\", \"function\": "
                             "{\"name\", \"arguments\"}}")
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            raise FieldError(f"{where}.tool_calls[{i}].function.arguments", "must be a JSON object as a string")
        out["tool_calls"].append({"type": "function", "id": as_text(str(call.get("id", ""))), "function": {
            "name": as_text(function["name"]), "arguments": _marked(arguments, as_text)}})
    return out


def default_rendering(messages: list[dict], tools: list[dict] | None,
                      as_text: Callable[[str], str]) -> list[dict]:
    """The messages with tools, tool calls and tool results written as plain text (module docstring), for a
    template without tool support. Where the contents are lists of parts (a multimodal checkpoint's template,
    chat_messages.parse_chat keep_parts), what is written goes in as text parts and a new system message is one."""
    out = [dict(m) for m in messages]
    parts = any(isinstance(m.get("content"), list) for m in out)
    for message in out:
        calls = message.pop("tool_calls", None)
        message.pop("tool_call_id", None)
        if parts and not isinstance(message.get("content"), list):
            message["content"] = [{"type": "text", "text": message["content"]}] if message.get("content") else []
        if calls:
            written = [_call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            message["content"] = _around_parts(message["content"], "", "\n".join(written)) if parts else \
                "\n".join(([message["content"]] if message.get("content") else []) + written)
        if message["role"] == "tool":
            message["role"] = "user"
            message["content"] = _around_parts(message["content"], "<tool_response>", "</tool_response>") if parts \
                else f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
        if message.get("content") is None:
            message["content"] = ""
    if tools:
        listed = "\n".join(json.dumps(_marked(t, as_text), ensure_ascii=False) for t in tools)
        system = _INSTRUCTIONS.format(tools=listed)
        if out and out[0]["role"] == "system":
            content = out[0]["content"]
            out[0]["content"] = _around_parts(content, "", f"\n{system}") if parts else f"{content}\n\n{system}"
        else:
            out.insert(0, {"role": "system", "content": [{"type": "text", "text": system}] if parts else system})
    return out


def _around_parts(parts: list[dict], before: str, after: str) -> list[dict]:
    """A multimodal template's content parts with text parts `before` and `after` them (where not empty); the
    template joins parts as it joins a message's text parts (SmolVLM's: on new lines)."""
    return ([{"type": "text", "text": before}] if before else []) + parts + \
        ([{"type": "text", "text": after}] if after else [])


def _call_text(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def _marked(value: Any, as_text: Callable[[str], str]) -> Any:
    """A JSON value with every string in it (keys too) passed through `as_text`."""
    if isinstance(value, str):
        return as_text(value)
    if isinstance(value, list):
        return [_marked(v, as_text) for v in value]
    if isinstance(value, dict):
        return {as_text(k): _marked(v, as_text) for k, v in value.items()}
    return value
