"""OpenAI request models (field names and ranges as in the OpenAI API reference) and response objects.

Requests are validated with Pydantic; a validation error becomes a 400 that names the field (`schema_error`).
Extensions beyond OpenAI's fields, as vLLM spells them: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`.
Fields we do not serve yet (tools, response_format other than text, logit_bias, audio output, suffix, best_of
other than n) are rejected with a 400 naming them rather than silently ignored; unknown fields are ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_backend.serving.errors import OpenAIError, invalid

MAX_SEED = 2**63 - 1
MEDIA_PARTS = ("image_url", "input_audio")  # content parts sent on to preprocess, which decodes them


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    n: int = Field(1, ge=1, le=128)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    ignore_eos: bool = False
    user: str | None = None
    logit_bias: dict[str, float] | None = None

    def check_common(self) -> None:
        """Cross-field rules Pydantic's per-field constraints cannot say.

        Raises:
            OpenAIError: 400 naming the field.
        """
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        if self.logit_bias:
            raise invalid("logit_bias is not supported by this server", "logit_bias")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(s == "" for s in stops):
            raise invalid("stop strings must not be empty", "stop")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_values(self) -> dict[str, Any]:
        """The Triton omni_chat inputs these settings become (absent ones are not sent)."""
        values = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "random_seed": self.seed, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos or None,
            "stop_words": [self.stop] if isinstance(self.stop, str) else (self.stop or None),
        }
        return {k: v for k, v in values.items() if v is not None}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None

    def check(self) -> None:
        """Raises OpenAIError (400 naming the field) for what the schema alone does not catch."""
        self.check_common()
        if not self.messages:
            raise invalid("messages must be a non-empty list", "messages")
        if self.tools or self.functions:
            raise invalid("tools are not supported by this server", "tools" if self.tools else "functions")
        if self.tool_choice not in (None, "none", "auto"):
            raise invalid("tool_choice is not supported by this server", "tool_choice")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise invalid("response_format: only {\"type\": \"text\"} is supported", "response_format")
        if self.audio is not None or (self.modalities and set(self.modalities) - {"text"}):
            raise invalid("audio output is not supported by this server yet", "modalities")
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def completion_limit(self) -> int | None:
        """max_completion_tokens (the current name) or max_tokens (deprecated), None when neither is set."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def messages_json(self) -> list[dict]:
        """The messages as the preprocess stage takes them: role + content (string, or text / image_url /
        input_audio parts; preprocess decodes the media and answers 400 naming the part for bad media).

        Raises:
            OpenAIError: a content part of another type (input_image, file, ...), naming it.
        """
        out = []
        for i, message in enumerate(self.messages):
            content = message.content
            if content is None:
                content = ""
            elif isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    kind = part.get("type")
                    where = f"messages[{i}].content[{j}]"
                    if kind in MEDIA_PARTS:  # decoded and checked by preprocess (omni_backend/stages/media.py)
                        if not isinstance(part.get(kind), (dict, str)):
                            raise invalid(f"{where} ({kind}) must have an object '{kind}'", where)
                        parts.append({"type": kind, kind: part[kind]})
                        continue
                    if kind in ("input_image", "file", "video_url", "audio_url"):
                        raise invalid(f"{where}: content part type '{kind}' is not supported by this server "
                                      "(text, image_url and input_audio are)", where)
                    if kind != "text" or not isinstance(part.get("text"), str):
                        raise invalid(f"{where} must be {{\"type\": \"text\", \"text\": string}}", where)
                    parts.append({"type": "text", "text": part["text"]})
                content = parts
            role = "system" if message.role == "developer" else message.role
            out.append({"role": role, "content": content})
        return out

    def logprobs_count(self) -> int | None:
        """Top alternatives per token for the engine, None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise invalid("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of must equal n (this server returns every sequence it generates)", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt as text or token ids.

        Raises:
            OpenAIError: an empty prompt (the whole list, a string or a token list), naming `prompt`.
        """
        prompt = self.prompt
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        if not items:
            raise invalid("prompt must not be empty", "prompt")
        for i, item in enumerate(items):
            if len(item) == 0:
                raise invalid("prompt must not be empty" if len(items) == 1 else f"prompt[{i}] must not be empty",
                              "prompt")
        return items


# ---------------------------------------------------------------------------------------------------------
# Validation errors -> 400 naming the field


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "is-instance", "literal"}


def schema_error(exc: ValidationError) -> OpenAIError:
    """The first Pydantic error as a 400 whose message and `param` name the field (e.g. `max_tokens`)."""
    error = exc.errors(include_url=False)[0]
    parts: list[str] = []
    for item in error["loc"]:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in ("body",) or item.lower() in _TYPE_TAGS or "[" in item or "-" in item:
            continue
        else:
            parts.append(("." if parts else "") + item)
    param = "".join(parts) or None
    if error["type"] == "missing":
        return invalid(f"'{param}' is a required property", param)
    given = error.get("input")
    shown = repr(given) if not isinstance(given, (dict, list)) else type(given).__name__
    return invalid(f"Invalid value for '{param}': {error['msg'].rstrip('.')} (got {shown})", param)


def parse_request(model: type[BaseModel], body: dict):
    """Validate a JSON object against a request model.

    Raises:
        OpenAIError: 400 naming the first invalid field, or the endpoint's own cross-field checks.
    """
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise schema_error(exc) from None
    request.check()
    return request


# ---------------------------------------------------------------------------------------------------------
# Response objects


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    """The postprocess stage's logprob entries as a chat choice's `logprobs` object."""
    return None if entries is None else {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict] | None, text_offset: int) -> dict | None:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset.

    Args:
        entries: the postprocess stage's entries for the generated tokens (prompt logprobs are not produced).
        text_offset: character offset of the first entry's token in the choice's text.
    """
    if entries is None:
        return None
    tokens, logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        tokens.append(entry["token"])
        logprobs.append(entry["logprob"])
        tops.append({top["token"]: top["logprob"] for top in entry.get("top_logprobs", [])})
        offsets.append(offset)
        offset += len(entry["token"])
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
