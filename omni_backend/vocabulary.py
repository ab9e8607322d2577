"""The request vocabulary shared by the front door, the stages and the error mapper (no torch, no Triton).

Two tables and one format:

- `SAMPLING_FIELDS`: every generation setting once, with its name on each side (the OpenAI request field, the
  Triton input tensor of `omni_chat`/`preprocess`, the `SamplingParams` attribute), its Triton datatype and its
  default; its range is `SamplingParams`' (`engine.sampling_params.RANGES`, the only source of sampling
  ranges). `PROMPT_TENSORS` are the prompt inputs (not settings).
- `DATATYPE_RANGES`: the values each Triton numeric datatype can hold, so that no integer is narrowed on its way
  into a tensor (Triton's HTTP JSON parser casts an INT32 value of 2**32 + 8 to 8).
- `ErrorKind` and `StageError`: the kinds of error a stage reports, with a stable code that crosses process
  boundaries in the error message itself, because Triton 2.51 hands a decoupled model's clients only the message
  (gRPC streams carry no status; `/generate` answers 400 whatever the status was). A stage's message starts with
  a header, `[<code>]`, `[<code> field=<field>]` or `[<code> retry_after=<s>]`, e.g.
  `[invalid_argument field=random_seed] random_seed must be an integer in [0, 9223372036854775807], got -1`;
  `StageError.parse` reads it back (after Triton's own "in ensemble '<name>', " prefix).
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass
from enum import Enum

from omni_backend import tensor_names as T
from omni_backend.engine.limits import ContextLengthExceeded
from omni_backend.engine.sampling_params import RANGES, Range, SamplingParams

# ---------------------------------------------------------------------------------------------------------
# Request fields


@dataclass(frozen=True)
class RequestField:
    """One generation setting's names and type on each side.

    Attributes:
        param: the `SamplingParams` attribute.
        tensor: the Triton input tensor of `omni_chat` and `preprocess` (shape [1], `stop_words` [-1]).
        datatype: the tensor's Triton datatype ("INT32", "UINT64", "FP32", "BOOL", "BYTES").
        openai: the OpenAI request fields it comes from, canonical name first (the chat endpoint's
            `max_completion_tokens` and `top_logprobs` are second names).
    """

    param: str
    tensor: str
    datatype: str
    openai: tuple[str, ...]

    @property
    def range(self) -> Range | None:
        """Allowed values (SamplingParams' RANGES), None for booleans and strings."""
        return RANGES.get(self.param)

    @property
    def allowed(self) -> Range | None:
        """The values a client may send: `range` within what the tensor's datatype holds (max_tokens: [1, 2**31 - 1];
        top_p: [2**-149, 1], as (0, 1] in FP32); None for booleans and strings."""
        own, holds = self.range, DATATYPE_RANGES.get(self.datatype)
        if own is None or holds is None:
            return own
        lows = [(low, open_) for low, open_ in ((own.low, own.low_open), (holds.low, holds.low_open)) if low is not None]
        low, low_open = max(lows, key=lambda item: (item[0], item[1])) if lows else (None, False)
        if low == 0 and low_open and self.datatype in SMALLEST_POSITIVE:  # a tinier positive number becomes 0 there
            low, low_open = SMALLEST_POSITIVE[self.datatype], False
        highs = [high for high in (own.high, holds.high) if high is not None]
        return Range(low, min(highs) if highs else None, low_open, own.integer)

    def problem(self, value) -> str | None:
        """What is wrong with `value` (a JSON scalar) for this field, or None (`tensor_value_problem` for
        booleans and strings)."""
        allowed = self.allowed
        if allowed is None:
            return tensor_value_problem(self.datatype, value)
        if allowed.contains(value):
            return None
        return f"must be {'an integer' if allowed.integer else 'a finite number'} in {allowed.describe()}, got {_shown(value)}"

    @property
    def default(self):
        """The value an absent field means (`max_tokens`: None, the rest of the context, filled by preprocess)."""
        if self.param == "max_tokens":
            return None
        spec = SamplingParams.__dataclass_fields__[self.param]
        return spec.default_factory() if spec.default is MISSING else spec.default


SAMPLING_FIELDS: tuple[RequestField, ...] = (
    RequestField("max_tokens", "max_tokens", "INT32", ("max_tokens", "max_completion_tokens")),
    RequestField("stream", "stream", "BOOL", ("stream",)),
    RequestField("temperature", "temperature", "FP32", ("temperature",)),
    RequestField("top_p", "top_p", "FP32", ("top_p",)),
    RequestField("top_k", "top_k", "INT32", ("top_k",)),
    RequestField("min_p", "min_p", "FP32", ("min_p",)),
    RequestField("seed", "random_seed", "UINT64", ("seed",)),
    RequestField("stop", "stop_words", "BYTES", ("stop",)),
    RequestField("repetition_penalty", "repetition_penalty", "FP32", ("repetition_penalty",)),
    RequestField("presence_penalty", "presence_penalty", "FP32", ("presence_penalty",)),
    RequestField("frequency_penalty", "frequency_penalty", "FP32", ("frequency_penalty",)),
    RequestField("ignore_eos", "ignore_eos", "BOOL", ("ignore_eos",)),
    RequestField("logprobs", "logprobs", "INT32", ("logprobs", "top_logprobs")),
    RequestField("prompt_logprobs", "prompt_logprobs", "INT32", ("prompt_logprobs",)),
    # the front door derives them from response_format (or vLLM's structured_outputs, whose errors it renames)
    RequestField("guide_type", T.GUIDED_DECODING_GUIDE_TYPE, "BYTES", ("response_format.type",)),
    RequestField("guide", T.GUIDED_DECODING_GUIDE, "BYTES", ("response_format",)),
)
BY_PARAM = {f.param: f for f in SAMPLING_FIELDS}
BY_TENSOR = {f.tensor: f for f in SAMPLING_FIELDS}

PROMPT_TENSORS = {"text_input": "BYTES", "prompt_token_ids": "INT32"}
"""Prompt inputs of `preprocess`: text (a plain prompt or a messages JSON array) or token ids (OpenAI `prompt`
or `messages`, by endpoint)."""

DATATYPE_RANGES: dict[str, Range] = {
    **{f"INT{bits}": Range(-2 ** (bits - 1), 2 ** (bits - 1) - 1, integer=True) for bits in (8, 16, 32, 64)},
    **{f"UINT{bits}": Range(0, 2**bits - 1, integer=True) for bits in (8, 16, 32, 64)},
    "FP16": Range(-65504.0, 65504.0),
    "FP32": Range(-3.4028234663852886e38, 3.4028234663852886e38),
    "FP64": Range(None),
}
"""Triton numeric datatype -> the values a tensor of it holds exactly (floats: finite and within range)."""
SMALLEST_POSITIVE = {"FP16": 2.0**-24, "FP32": 2.0**-149}
"""Triton float datatype -> its smallest positive value (the least subnormal, IEEE 754): a positive number below
it is stored as 0."""


def tensor_value_problem(datatype: str, value) -> str | None:
    """What is wrong with `value` (a JSON scalar) as an element of a Triton tensor of `datatype`, or None.

    Strict JSON types: an integer datatype takes only integers (not booleans, not 3.0), a floating-point one
    integers or floats, BOOL only true/false, BYTES only strings.
    """
    if datatype == "BOOL":
        return None if isinstance(value, bool) else f"must be a boolean, got {_shown(value)}"
    if datatype == "BYTES":
        return None if isinstance(value, str) else f"must be a string, got {_shown(value)}"
    allowed = DATATYPE_RANGES.get(datatype)
    if allowed is None:
        return None
    if not allowed.contains(value):
        kind = "an integer" if allowed.integer else "a finite number"
        return f"must be {kind} in {allowed.describe()} ({datatype}), got {_shown(value)}"
    return None


def openai_param(field: str, prompt_field: str) -> str:
    """The OpenAI request field a stage's `field` (a tensor name, maybe followed by a path such as
    `text_input[0].content[1]`) came from: `random_seed` -> `seed`, `text_input[0].content[1]` ->
    `messages[0].content[1]` when the prompt arrived as `prompt_field` "messages"."""
    tensor = re.match(r"[A-Za-z_][A-Za-z0-9_]*", field)
    name = tensor.group(0) if tensor else field
    rest = field[len(name):]
    if name in PROMPT_TENSORS:
        return prompt_field + rest
    if name in BY_TENSOR:
        return BY_TENSOR[name].openai[0] + rest
    return field


def _shown(value) -> str:
    text = "null" if value is None else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------------------------------------
# Error kinds


class ErrorKind(Enum):
    """What went wrong, as every process names it: the code on the wire, the HTTP status, the OpenAI error
    type, and the Triton error code a stage answers with (pb_utils.TritonError's constant name)."""

    INVALID_ARGUMENT = ("invalid_argument", 400, "invalid_request_error", "INVALID_ARG")
    CONTEXT_LENGTH_EXCEEDED = ("context_length_exceeded", 400, "invalid_request_error", "INVALID_ARG")
    QUEUE_FULL = ("queue_full", 429, "rate_limit_error", "UNAVAILABLE")
    NOT_ADMITTING = ("not_admitting", 503, "server_error", "UNAVAILABLE")
    UNAVAILABLE = ("unavailable", 503, "server_error", "UNAVAILABLE")
    INTERNAL = ("internal", 500, "server_error", "INTERNAL")

    def __init__(self, code: str, http_status: int, openai_type: str, triton_code: str):
        self.code, self.http_status, self.openai_type, self.triton_code = code, http_status, openai_type, triton_code


_BY_CODE = {kind.code: kind for kind in ErrorKind}
_ENSEMBLE_PREFIX = re.compile(r"^(?:in ensemble '[^']*', )+")  # Triton's own prefix for a step's error
_HEADER = re.compile(r"^\[(?P<code>[a-z_]+)(?: field=(?P<field>\S+))?(?: retry_after=(?P<retry>\d+))?\] ",
                     re.DOTALL)


class FieldError(ValueError):
    """A bad value of one request field; str() starts with the field.

    Args:
        field: the tensor name, maybe followed by a path into it (`text_input[0].content[1]`).
        problem: what is wrong ("must be at most 2048 (max_model_len), got 5000").
    """

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem


class StageError(Exception):
    """An error of a known kind, as a stage reports it and the front door reads it.

    Args:
        kind: the ErrorKind.
        message: for people; when `field` is given it starts with the field's name.
        field: the request field at fault (see FieldError), or None.
        retry_after_s: seconds a client should wait (QUEUE_FULL, NOT_ADMITTING, UNAVAILABLE), or None.
    """

    def __init__(self, kind: ErrorKind, message: str, field: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.kind, self.message, self.field, self.retry_after_s = kind, message, field, retry_after_s

    def wire(self) -> str:
        """The message with its header, as it crosses to other processes."""
        header = self.kind.code
        if self.field is not None:
            header += f" field={self.field}"
        if self.retry_after_s is not None:
            header += f" retry_after={self.retry_after_s}"
        return f"[{header}] {self.message}"

    @classmethod
    def of(cls, exc: BaseException, stage: str) -> "StageError":
        """The StageError a stage answers for `exc`: itself, CONTEXT_LENGTH_EXCEEDED for the engine's
        ContextLengthExceeded, INVALID_ARGUMENT for a ValueError (naming the field of a FieldError), INTERNAL
        "<stage> failed: <type>: <exc>" for anything else."""
        if isinstance(exc, StageError):
            return exc
        if isinstance(exc, ContextLengthExceeded):
            return cls(ErrorKind.CONTEXT_LENGTH_EXCEEDED, str(exc))
        if isinstance(exc, FieldError):
            return cls(ErrorKind.INVALID_ARGUMENT, str(exc), exc.field)
        if isinstance(exc, ValueError):
            return cls(ErrorKind.INVALID_ARGUMENT, str(exc))
        return cls(ErrorKind.INTERNAL, f"{stage} failed: {type(exc).__name__}: {exc}")

    @classmethod
    def parse(cls, text: str) -> "StageError | None":
        """The StageError in a message received from Triton (a header after Triton's "in ensemble '<name>', "
        prefixes), None when the message has no header (Triton's own errors)."""
        match = _HEADER.match(_ENSEMBLE_PREFIX.sub("", text))
        if match is None or match["code"] not in _BY_CODE:
            return None
        retry = int(match["retry"]) if match["retry"] else None
        return cls(_BY_CODE[match["code"]], _ENSEMBLE_PREFIX.sub("", text)[match.end():], match["field"], retry)
