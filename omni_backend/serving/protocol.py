"""OpenAI request models for chat and completions, and the small response objects both share.

Field names follow the OpenAI API reference; the ranges of the sampling settings are `SamplingParams`' (through
`omni_backend.vocabulary`), narrowed where a Triton tensor type holds less (max_tokens and top_k are INT32).
Extensions beyond OpenAI's fields, as vLLM spells them: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`.
A chat request with `audio` or with "audio" among its `modalities` asks for a spoken answer
(serving/spoken.py): `audio.voice` (a voice name, or OpenAI's `{"id": name}`) and `audio.format` are checked here
with the same messages as `/v1/audio/speech`'s `voice` and `response_format` (serving/audio_fields.py).

Types are strict, as JSON has them: `"stream": "yes"` or `"max_tokens": "16"` is a 400 naming the field, never
read as true or 16; a number without a fraction is an integer (`16.0` is 16: JSON has one number type, and JSON
Schema, which the published OpenAPI document is written in, counts 16.0 as an integer). `null` means the default
for every field the OpenAI API reference marks nullable (all the optional settings here, plus `user`); `model`,
`messages`, `prompt` and the extension `ignore_eos` must not be null. A validation error becomes a 400 that names the field (`schema_error`).

No field is silently dropped when it would change the answer. Every top-level field is one of: modelled here and
served (some only in part: the legacy functions, logit_bias, suffix and best_of other than n are refused when set;
`response_format` and vLLM's `structured_outputs` constrain the answer to a grammar, serving/structured.py);
describing the client or the request's bookkeeping (`DESCRIPTIVE_FIELDS`: accepted, no effect on the answer); a
known OpenAI or vLLM field this server does not serve (`NOT_SERVED`: accepted only with the value that asks for
what the server does anyway, else a 400 naming it); or unknown (a 400 naming it, as OpenAI answers "Unrecognized
request argument supplied").
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

import annotated_types
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from omni_backend import tensor_names as T
from omni_backend.serving.errors import OpenAIError, integral, invalid
from omni_backend.serving.generation import GenerationRequest, Prompt
from omni_backend.serving.structured import Guide, requested_guide
from omni_backend.serving.tools import ToolRequest, check_tool_calls, requested_tools
from omni_backend.serving.audio_fields import speech_format, speech_voice
from omni_backend.stages.tts_options import SpeechOptions
from omni_backend.vocabulary import BY_PARAM, DATATYPE_RANGES

MAX_N = 128
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit on `logprobs`
MEDIA_PARTS = ("image_url", "input_audio", "video_url")  # content parts sent on to preprocess, which decodes them
CHAT_AUDIO_FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "pcm16": "pcm"}  # OpenAI's name -> tts_audio's


def setting_bounds(param: str) -> dict[str, float]:
    """Pydantic's bounds (`ge`/`gt`, `le`) of the sampling setting `param`: the vocabulary's `allowed` range
    (SamplingParams' range within what its tensor's type holds)."""
    allowed = BY_PARAM[param].allowed
    bounds: dict[str, float] = {}
    if allowed.low is not None:
        bounds["gt" if allowed.low_open else "ge"] = allowed.low
    if allowed.high is not None:
        bounds["le"] = allowed.high
    return bounds


def setting(param: str, default=None):
    """A pydantic Field for the (float) sampling setting `param`, within `setting_bounds(param)`."""
    return Field(default, **setting_bounds(param))


def integer(**bounds: float) -> Any:
    """A JSON integer type within pydantic `bounds` (`ge=0, le=5`): strict (no strings, no booleans), 16.0 is 16.
    The bounds come before the validator: Pydantic then writes them into the JSON schema as minimum/maximum (also
    where the type is in a union with None)."""
    return Annotated[(int, *annotated_types.Interval(**bounds), BeforeValidator(integral))]


Count = integer(ge=1, le=MAX_N)
Seed = integer(**setting_bounds("seed"))
TopK = integer(**setting_bounds("top_k"))
MaxTokens = integer(**setting_bounds("max_tokens"))
TopLogprobs = integer(**setting_bounds("logprobs"))
TokenId = integer()  # prompts() names one beyond INT32


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = None


DESCRIPTIVE_FIELDS = frozenset({
    "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",  # OpenAI: about the client
    "prediction",  # OpenAI predicted outputs: a latency hint, the answer is the same
    "request_id",  # vLLM: the caller's id for its own logs
})
"""Request fields that describe the client or its bookkeeping, not the answer: accepted, not acted on."""

_ANY: tuple = ()  # NOT_SERVED: no value is what this server does
NOT_SERVED: dict[str, tuple] = {
    # OpenAI
    "reasoning_effort": _ANY, "verbosity": _ANY, "web_search_options": _ANY, "function_call": ("none", "auto"),
    # vLLM's sampling extensions
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "min_tokens": (0,), "stop_token_ids": ([],),
    "bad_words": ([],), "allowed_token_ids": _ANY, "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": _ANY,
    "prompt_logprobs": _ANY, "logits_processors": _ANY, "priority": (0,), "cache_salt": _ANY,
    "return_tokens_as_token_ids": (False,), "return_token_ids": (False,), "kv_transfer_params": _ANY,
    "vllm_xargs": _ANY, "prompt_embeds": _ANY,
    # vLLM's structured outputs
    "guided_json": _ANY, "guided_regex": _ANY, "guided_choice": _ANY, "guided_grammar": _ANY,
    "guided_decoding_backend": _ANY, "guided_whitespace_pattern": _ANY,
    # vLLM's chat extensions (the template is the checkpoint's; add_special_tokens: chat prompts get none)
    "echo": (False,), "add_special_tokens": (False,), "chat_template": _ANY, "chat_template_kwargs": ({},),
    "documents": _ANY, "mm_processor_kwargs": _ANY, "best_of": (1,),
}
"""Known OpenAI and vLLM request fields whose effect this server does not implement -> the values that ask for what
it does anyway (accepted); any other value is a 400 naming the field. Fields a request model declares are its own
(completions' `echo` and `best_of` are served)."""


class _Request(BaseModel):
    """What chat and completions share."""

    model_config = ConfigDict(extra="ignore", strict=True)
    NOT_NULLABLE: ClassVar[frozenset[str]] = frozenset({"model", "ignore_eos"})
    NOT_SERVED: ClassVar[dict[str, tuple]] = NOT_SERVED

    @classmethod
    def check_fields(cls, body: dict) -> None:
        """Refuse the fields this endpoint would otherwise drop while they change the answer (module docstring);
        `null` is every field's default.

        Raises:
            OpenAIError: 400 naming the first such field.
        """
        for name, value in body.items():
            if name in cls.model_fields or name in DESCRIPTIVE_FIELDS:
                continue
            if name not in cls.NOT_SERVED:
                raise invalid(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
            allowed = cls.NOT_SERVED[name]
            if value is None or any(type(value) is type(a) and value == a for a in allowed):
                continue
            shown = " or ".join(json.dumps(a) for a in allowed)
            raise invalid(f"{name} is not supported by this server" + (f" (only {shown}, what it does anyway)"
                                                                       if allowed else ""), name,
                          "unsupported_parameter")

    model: str
    frequency_penalty: float | None = setting("frequency_penalty")
    presence_penalty: float | None = setting("presence_penalty")
    repetition_penalty: float | None = setting("repetition_penalty")
    n: Count = 1
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = setting("temperature")
    top_p: float | None = setting("top_p")
    top_k: TopK | None = None
    min_p: float | None = setting("min_p")
    ignore_eos: bool = False
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's (serving/structured.py)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, body: Any) -> Any:
        """Drop `null` values of nullable fields, so they take their defaults."""
        if isinstance(body, dict):
            return {k: v for k, v in body.items() if v is not None or k in cls.NOT_NULLABLE}
        return body

    def check_common(self) -> None:
        """Cross-field rules Pydantic's per-field constraints cannot say.

        Raises:
            OpenAIError: 400 naming the field.
        """
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        if self.logit_bias:
            raise invalid("logit_bias is not supported by this server", "logit_bias")
        if any(s == "" for s in self.stops()):
            raise invalid("stop strings must not be empty", "stop")
        self.guide()

    def guide(self) -> Guide | None:
        """The grammar the output must follow (response_format or structured_outputs), None for free text.
        Raises OpenAIError 400 naming the field (serving/structured.py)."""
        return requested_guide(self.response_format, self.structured_outputs)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def settings(self) -> dict[str, Any]:
        """The sampling settings given, by SamplingParams attribute (absent ones are left to the stages)."""
        values = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "seed": self.seed, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos or None, "stop": self.stops() or None, "stream": self.stream,
        }
        return {k: v for k, v in values.items() if v is not None}


class ChatMessage(BaseModel):
    """One chat message. `content` is required (not null) except on an assistant message that carries `tool_calls`
    (the older `function_call` is refused). A tool message's `tool_call_id` goes to the template with it. `name` is
    accepted and not shown to the model (the chat template decides what it renders)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None


class AudioOutput(BaseModel):
    """A chat request's `audio`: how to speak the answer."""

    model_config = ConfigDict(extra="ignore", strict=True)

    voice: str | dict[str, Any]
    format: str


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    modalities: list[str] | None = None
    audio: AudioOutput | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    _voices: tuple[str, ...] | None = PrivateAttr(default=None)  # the served model's own (parse_request's voices)

    NOT_NULLABLE: ClassVar[frozenset[str]] = _Request.NOT_NULLABLE | {"messages"}

    @property
    def spoken(self) -> bool:
        """The answer is to be spoken too: `audio` is given or "audio" is among the `modalities`."""
        return self.audio is not None or "audio" in (self.modalities or [])

    def check(self) -> None:
        """Raises OpenAIError (400 naming the field) for what the schema alone does not catch. The chat template
        flags are checked by preprocess, which knows the messages' roles as the template sees them."""
        if self.spoken:
            modalities = self.modalities or ["text", "audio"]
            if set(modalities) - {"text", "audio"} or "audio" not in modalities:
                raise invalid("modalities must be [\"text\", \"audio\"] for audio output", "modalities")
            if self.audio is None:
                raise invalid("'audio' ({\"voice\", \"format\"}) is required when modalities include \"audio\"",
                              "audio")
            self.speech_options()
        self.check_common()
        if not self.messages:
            raise invalid("messages must be a non-empty list", "messages")
        for i, message in enumerate(self.messages):
            calls = message.tool_calls or message.function_call is not None  # {} asks for a call too
            if message.content is None and not (message.role == "assistant" and calls):
                raise invalid(f"messages[{i}].content is required: a string or a list of content parts (only an "
                              "assistant message with tool_calls may leave it out)", f"messages[{i}].content")
            check_tool_calls(message.tool_calls or [], f"messages[{i}].tool_calls")
            if message.function_call is not None:
                raise invalid(f"messages[{i}].function_call is not supported by this server (use tool_calls)",
                              f"messages[{i}].function_call")
        if self.functions:
            raise invalid("functions is not supported by this server (use tools)", "functions")
        tools = self.tool_request()
        if tools is not None and tools.choice in ("required", "named") and self.guide() is not None:
            raise invalid("tool_choice \"required\" or a named function cannot be combined with response_format or "
                          "structured_outputs", "tool_choice")
        if not self.spoken and self.modalities and set(self.modalities) - {"text"}:
            raise invalid("modalities: [\"text\"], or [\"text\", \"audio\"] with \"audio\" for audio output",
                          "modalities")
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.spoken:
            if self.n != 1:
                raise invalid("n must be 1 when audio output is requested", "n")
            if self.stream and self.audio.format != "pcm16":
                raise invalid("streamed audio output needs audio.format 'pcm16'", "audio.format")
            if self.logprobs:
                raise invalid("logprobs are not available with audio output", "logprobs")
            if self.tools:
                raise invalid("tools are not available with audio output", "tools")

    def tool_request(self) -> ToolRequest | None:
        """The checked tools (serving/tools.py), None without tools. Raises OpenAIError 400 naming the field."""
        return requested_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def speech_options(self) -> SpeechOptions | None:
        """How to speak the answer (None: it is only written). Raises OpenAIError 400 naming `audio.voice` or
        `audio.format`."""
        if self.audio is None:
            return None
        return SpeechOptions(voice=speech_voice(self.audio.voice, "audio.voice", self._voices),
                             audio_format=speech_format(self.audio.format, "audio.format", CHAT_AUDIO_FORMATS))

    def generation(self) -> GenerationRequest:
        """The pipeline request: the messages as preprocess's messages JSON, the settings by vocabulary name
        (max_completion_tokens, else the deprecated max_tokens; neither: the rest of the context)."""
        settings = self.settings()
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if limit is not None:
            settings["max_tokens"] = limit
        if self.logprobs:
            settings["logprobs"] = self.top_logprobs or 0
        template = {name: value for name, value, default in (
            ("add_generation_prompt", self.add_generation_prompt, True),
            ("continue_final_message", self.continue_final_message, False)) if value != default}
        tools = self.tool_request()
        if tools is not None:
            template[T.TOOLS] = tools.prompt_tools()
        return GenerationRequest(
            kind="chat", model=self.model, prompt_field="messages",
            prompts=[Prompt(text=json.dumps(self.messages_json(), ensure_ascii=False), template=template)],
            settings=settings, n=self.n, include_usage=self.include_usage, speech=self.speech_options(),
            guide=self.guide() or (tools.guide() if tools else None), tools=tools,
            own_voice=self.spoken and self._voices is not None)

    def messages_json(self) -> list[dict]:
        """The messages as the preprocess stage takes them: role + content (string, or text / image_url /
        input_audio / video_url parts; preprocess decodes the media and answers 400 naming the part for bad media).

        Raises:
            OpenAIError: a content part of another type (input_image, file, ...), naming it.
        """
        out = []
        for i, message in enumerate(self.messages):
            content = message.content
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    kind = part.get("type")
                    where = f"messages[{i}].content[{j}]"
                    if kind in MEDIA_PARTS:  # decoded and checked by preprocess (omni_backend/stages/media.py)
                        if not isinstance(part.get(kind), (dict, str)):
                            raise invalid(f"{where} ({kind}) must have an object '{kind}'", where)
                        parts.append({"type": kind, kind: part[kind]})
                        continue
                    if kind in ("input_image", "file", "audio_url"):
                        raise invalid(f"{where}: content part type '{kind}' is not supported by this server "
                                      "(text, image_url, input_audio and video_url are)", where)
                    if kind != "text" or not isinstance(part.get("text"), str):
                        raise invalid(f"{where} must be {{\"type\": \"text\", \"text\": string}}", where)
                    parts.append({"type": "text", "text": part["text"]})
                content = parts
            role = "system" if message.role == "developer" else message.role
            out.append({"role": role, "content": content})
            if message.tool_calls:
                out[-1]["tool_calls"] = message.tool_calls
            if message.tool_call_id is not None:
                out[-1]["tool_call_id"] = message.tool_call_id
        return out


class CompletionRequest(_Request):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: integer(ge=0, le=DATATYPE_RANGES["INT32"].high) = 16
    echo: bool = False
    logprobs: integer(ge=0, le=MAX_COMPLETION_LOGPROBS) | None = None
    best_of: integer(ge=1) | None = None
    suffix: str | None = None

    NOT_NULLABLE: ClassVar[frozenset[str]] = _Request.NOT_NULLABLE | {"prompt"}
    # a text prompt gets the tokens the tokenizer adds around a text (vLLM's completions default)
    NOT_SERVED: ClassVar[dict[str, tuple]] = NOT_SERVED | {"add_special_tokens": (True,)}

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise invalid("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of must equal n (this server returns every sequence it generates)", "best_of")

    def generation(self) -> GenerationRequest:
        """The pipeline request: one Prompt per prompt. With `echo` and `logprobs` the prompt's tokens get logprobs
        too (`prompt_logprobs`, as vLLM names it). `max_tokens` 0 generates nothing: the prompt is still checked
        and echoed, and when its logprobs are asked the llm stage runs its prefill for one token that is dropped
        (the logprobs come from the prefill)."""
        settings = self.settings()
        if self.logprobs is not None:
            settings["logprobs"] = self.logprobs
        prompt_logprobs = self.echo and self.logprobs is not None
        if prompt_logprobs:
            settings["prompt_logprobs"] = self.logprobs
        if self.max_tokens or prompt_logprobs:
            settings["max_tokens"] = self.max_tokens or 1
        return GenerationRequest(
            kind="completion", model=self.model, prompt_field="prompt", prompts=self.prompts(), settings=settings,
            n=self.n, include_usage=self.include_usage, echo=self.echo, generate=self.max_tokens > 0,
            prompt_logprobs=prompt_logprobs, guide=self.guide())

    def prompts(self) -> list[Prompt]:
        """Each prompt as text or token ids.

        Raises:
            OpenAIError: an empty prompt (the whole list, a string or a token list), or a token id beyond
                INT32, naming `prompt`.
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
        prompts = []
        for i, item in enumerate(items):
            if len(item) == 0:
                raise invalid("prompt must not be empty" if len(items) == 1 else f"prompt[{i}] must not be empty",
                              "prompt")
            if isinstance(item, str):
                prompts.append(Prompt(text=item, template={T.PROMPT_IS_TEXT: True}))  # never a messages array
                continue
            if not all(DATATYPE_RANGES["INT32"].contains(token) for token in item):
                raise invalid(f"prompt holds a token id outside the INT32 range: {max(item, key=abs)}", "prompt")
            prompts.append(Prompt(token_ids=item))
        return prompts


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


def parse_request(model: type[_Request], body: dict, voices: tuple[str, ...] | None = None):
    """Validate a JSON object against a request model; `voices`: the served model's own (chat speaks in one).

    Raises:
        OpenAIError: 400 naming the first field that is not served (`check_fields`) or invalid, or the endpoint's
            own cross-field checks.
    """
    model.check_fields(body)
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise schema_error(exc) from None
    if voices is not None:
        request._voices = voices
    request.check()
    return request


# ---------------------------------------------------------------------------------------------------------
# Response objects


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's `usage` object (token counts); `prompt_tokens_details.cached_tokens` (always present, 0 when
    nothing was reused) counts the prompt tokens whose KV the prefix cache supplied, as OpenAI and vLLM report it."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
