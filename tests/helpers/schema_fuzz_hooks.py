"""schemathesis hooks for tests/reliability/test_schema_fuzz.py (loaded with `SCHEMATHESIS_HOOKS`): keep whatever
can become a real generation short, as tests/reliability/test_fuzz.py does, and give media parts real media.

Only values the schema allows and that would run long are lowered (an absent or null length is the rest of the
context): `max_tokens`/`max_completion_tokens` to MAX_NEW_TOKENS, `n` to MAX_N, image `steps` to MAX_STEPS, speech
`input` to MAX_SPEECH_CHARS; completions prompts get what every model can read (`_tokenizable`). Negative cases
are left as they were generated.

A chat content part's media (an image URL, an audio clip, a video URL) is a file no schema can describe, so each
media part generated with its schema's shape gets a real small file of its kind (`media`), and the parts beyond the
preprocess stage's `max_media_parts` per request become text parts. The test model has no video encoder (the
schema cannot say which media kinds a checkpoint reads), so video parts get the image.

Grammars (`_compilable`): whether a JSON schema, a regex or an EBNF grammar compiles, and which function names a
request's `tool_choice` may name, are facts of the values, not of their shapes; so a positive case keeps the kind
of grammar it drew with a value known to compile, tool names made distinct, and a named `tool_choice` naming one
of its tools.
"""

from __future__ import annotations

import base64
import functools

import numpy as np
import schemathesis
from schemathesis import GenerationMode
from helpers.media_inputs import audio_bytes, data_uri, image_bytes

from omni_backend.serving.protocol import MEDIA_PARTS
from omni_backend.stages.media import MediaLimits

MAX_NEW_TOKENS = 4
MAX_N = 2
MAX_STEPS = 2
MAX_SPEECH_CHARS = 60
LENGTHS = {  # operation path -> the fields that set how long a generation runs, and their caps
    "/v1/chat/completions": {"max_tokens": MAX_NEW_TOKENS, "max_completion_tokens": MAX_NEW_TOKENS, "n": MAX_N},
    "/v1/completions": {"max_tokens": MAX_NEW_TOKENS, "n": MAX_N},
    "/v1/images/generations": {"steps": MAX_STEPS, "n": MAX_N},
    "/v2/models/{model}/generate": {"max_tokens": MAX_NEW_TOKENS},
    "/v2/models/{model}/generate_stream": {"max_tokens": MAX_NEW_TOKENS},
}
UNSET_MEANS_LONG = {"max_tokens", "max_completion_tokens", "steps"}


@functools.cache
def media() -> dict[str, dict]:
    """A real small file per media part type the test model reads, as that part's payload: a 16x16 PNG, 0.2 s of
    a 440 Hz tone as WAV."""
    pixels = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(3200) / 16000)).astype(np.float32)
    return {"image_url": {"url": data_uri(image_bytes("PNG", pixels))},
            "input_audio": {"data": base64.b64encode(audio_bytes("WAV", tone, 16000)).decode(), "format": "wav"}}


GOOD_GUIDES = {"json": {"type": "object"}, "regex": "[a-z]{1,3}", "choice": ["yes", "no"],
               "grammar": 'root ::= "a" | "b"', "json_object": True}


def _compilable(body: dict) -> None:
    """Grammars that compile and tool choices that name a given tool (the module docstring says why)."""
    fmt, outputs = body.get("response_format"), body.get("structured_outputs")
    if isinstance(fmt, dict) and isinstance(fmt.get("json_schema"), dict) and fmt["json_schema"].get("schema"):
        fmt["json_schema"]["schema"] = GOOD_GUIDES["json"]
    guided = isinstance(fmt, dict) and fmt.get("type") != "text"
    if isinstance(outputs, dict):
        drawn = [kind for kind in GOOD_GUIDES if outputs.get(kind) not in (None, False)] or ["regex"]
        body["structured_outputs"] = None if guided else {drawn[0]: GOOD_GUIDES[drawn[0]]}
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    for i, tool in enumerate(tools):
        tool["function"]["name"] = f"{tool['function']['name'][:60]}_{i}"
        if tool["function"].get("parameters"):
            tool["function"]["parameters"] = GOOD_GUIDES["json"]
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        if not tools:
            body["tool_choice"] = "auto"
        else:
            if isinstance(choice, dict):
                choice["function"]["name"] = tools[0]["function"]["name"]
            body["response_format"] = body["structured_outputs"] = None
    for message in body.get("messages") if isinstance(body.get("messages"), list) else ():
        for call in (message.get("tool_calls") or ()) if isinstance(message, dict) else ():
            call["function"]["arguments"] = "{}"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _real_media(body: dict) -> None:
    """Give each media part of the messages a real file; parts past the per-request limit become text."""
    left = MediaLimits().max_media_parts
    for message in body.get("messages") if isinstance(body.get("messages"), list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in MEDIA_PARTS or not isinstance(part.get(kind), dict):
                continue  # a text part
            if left == 0:
                content[i] = {"type": "text", "text": "and"}
                continue
            left -= 1
            if kind == "video_url":
                content[i] = part = {"type": "image_url", "image_url": {}}
                kind = "image_url"
            part[kind] = {**part[kind], **media()[kind]}


@schemathesis.hook
def map_case(context, case):
    """Positive cases only: a negative one is to be refused before anything runs (else it fails the run anyway),
    and changing it could make it valid while it still counts as negative."""
    body = case.body
    if case.meta is None or case.meta.generation.mode != GenerationMode.POSITIVE or not isinstance(body, dict):
        return case
    path = case.operation.path
    for field, cap in LENGTHS.get(path, {}).items():
        value = body.get(field)
        if (value is None and field in UNSET_MEANS_LONG) or (_is_number(value) and value > cap):
            body[field] = cap
    if path in ("/v1/chat/completions", "/v1/completions"):
        _compilable(body)
    if path == "/v1/chat/completions":
        _real_media(body)
    if path == "/v1/completions":
        body["prompt"] = _tokenizable(body.get("prompt"))
    text = body.get("input")
    if path == "/v1/audio/speech" and isinstance(text, str) and len(text) > MAX_SPEECH_CHARS:
        body["input"] = text[:MAX_SPEECH_CHARS - 1] + "a"  # still something to speak
    return case


def _tokenizable(prompt):
    """Token ids below 256, which every vocabulary has, and text with a letter in it, which every tokenizer keeps
    (the schema cannot say the model's vocabulary size, nor which characters its tokenizer drops)."""
    if isinstance(prompt, list):
        return [_tokenizable(item) for item in prompt]
    if isinstance(prompt, str):
        return prompt + "a"
    return prompt % 256 if _is_number(prompt) else prompt
