"""OpenAI chat messages as preprocess reads them: the messages JSON array, its media parts, and the chat
template flags (vLLM's `add_generation_prompt` / `continue_final_message`)."""

from __future__ import annotations

import json
from typing import Callable

from omni_backend import tensor_names as T
from omni_backend.stages.tool_prompt import tool_call_fields
from omni_backend.vocabulary import FieldError

# a content part's type -> its media kind
MEDIA_PART_TYPES = {"image_url": "image", "input_audio": "audio", "video_url": "video"}


def parse_messages(text: str) -> list[dict]:
    """Parse an OpenAI-style messages JSON array of text content into `[{"role": str, "content": str}, ...]`
    (see `parse_chat`)."""
    return parse_chat(text)[0]


def parse_chat(text: str, marker: str | None = None, keep_parts: bool = False,
               as_text: Callable[[str], str] = str) -> tuple[list[dict], list[dict]]:
    """Parse an OpenAI-style messages JSON array into `[{"role": str, "content": str}, ...]` and its media parts.

    `content` is a string, or a list of parts joined with newlines: `{"type": "text", "text": str}`, and, when
    `marker` is given, `image_url` / `input_audio` / `video_url` parts, each written into the content as `marker`
    and returned (in order) as `{"kind": "image"|"audio"|"video", "part": <the part>, "slot": <its entry in the
    kept parts>, "field": "text_input[i].content[j]"}`. With `keep_parts`, every content is instead the list of
    parts transformers' multimodal chat templates read: `{"type": "text", "text": str}` and
    `{"type": "image"|"audio"|"video"}` in place of each media part. Every string the client wrote (roles,
    contents, text parts) goes through `as_text`
    (`ChatTemplate.mark`, so that its control-token strings stay text). An assistant message may carry
    `tool_calls` (its content then may be null) and a tool message `tool_call_id`: they are kept as
    transformers' templates take them (stages/tool_prompt.py).

    Raises:
        FieldError: not valid JSON, not a non-empty array, or a message of the wrong shape (the field names the
            offending message or part, e.g. `text_input[0].content`).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FieldError(T.TEXT_INPUT, f"starts with '[' but is not a valid messages JSON array: {exc.msg} "
                         f"(line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(value, list) or not value:
        raise FieldError(T.TEXT_INPUT, "messages must be a non-empty JSON array of {role, content} objects")
    messages, media = [], []
    for index, message in enumerate(value):
        where = f"text_input[{index}]"
        if not isinstance(message, dict):
            raise FieldError(where, "must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise FieldError(f"{where}.role", "must be a non-empty string")
        role = as_text(role)
        if isinstance(content, list):
            texts, parts = [], []
            for part_index, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if marker is not None and kind in MEDIA_PART_TYPES:
                    parts.append({"type": MEDIA_PART_TYPES[kind]})
                    media.append({"kind": MEDIA_PART_TYPES[kind], "part": part, "slot": parts[-1],
                                  "field": f"{where}.content[{part_index}]"})
                    texts.append(marker)
                    continue
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise FieldError(f"{where}.content[{part_index}]", "must be {\"type\": \"text\", \"text\": string}"
                                     + ("" if marker is None else " or an image_url / input_audio / video_url part"))
                texts.append(as_text(part["text"]))
                parts.append({"type": "text", "text": texts[-1]})
            content = parts if keep_parts else "\n".join(texts)
        elif content is None and message.get("tool_calls"):
            pass  # an assistant's tool calls without text
        elif not isinstance(content, str):
            raise FieldError(f"{where}.content", "must be a string or a list of text parts")
        elif keep_parts:
            content = [{"type": "text", "text": as_text(content)}]
        else:
            content = as_text(content)
        messages.append({"role": role, "content": content, **tool_call_fields(message, where, as_text)})
    return messages, media


def check_template_flags(messages: list[dict], add_generation_prompt: bool, continue_final_message: bool) -> None:
    """The chat template flags against each other and the messages (vLLM's rules for its chat fields).

    Raises:
        FieldError: both flags true, or `continue_final_message` with a last message that is not an assistant's.
    """
    if continue_final_message and add_generation_prompt:
        raise FieldError(T.CONTINUE_FINAL_MESSAGE, "cannot be true together with add_generation_prompt: continuing "
                         "the last message asks for no new assistant turn (set add_generation_prompt to false)")
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise FieldError(T.CONTINUE_FINAL_MESSAGE, f"needs the last message to be the assistant's message to "
                         f"continue, got role '{messages[-1]['role']}'")
