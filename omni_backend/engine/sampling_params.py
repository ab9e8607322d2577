"""Per-request sampling settings, their allowed ranges, and their validation.

`RANGES` is the one table of numeric ranges: the OpenAI API reference for temperature [0, 2],
presence/frequency penalty [-2, 2] and top_logprobs [0, 20], and vLLM's `SamplingParams` for the extensions
(top_k >= -1, min_p [0, 1], repetition_penalty > 0 after the CTRL paper, Keskar et al. 2019). The request
vocabulary (`omni_backend.vocabulary`) and the OpenAI front door read their ranges from here.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag")
"""Grammar kinds (TensorRT-LLM's `guided_decoding_guide_type` values; engine/structured_output.py)."""
MAX_GUIDE_CHARS = 65536
"""Longest guide (a schema, regex or grammar), characters: bounds what one request can make the compiler do."""
# Temperatures below this sample greedily (vLLM's SamplingParams uses the same 1e-5, _SAMPLING_EPS): logits / T
# overflows float32 to inf for a tiny T (1e-38), and the softmax of an inf row is NaN.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Range:
    """The allowed values of one numeric setting: from `low` to `high` inclusive, `low` itself excluded when
    `low_open`; None is unbounded on that side. `integer`: only integers (a bool is not one)."""

    low: float | None
    high: float | None = None
    low_open: bool = False
    integer: bool = False

    def contains(self, value) -> bool:
        """True when `value` has the right type (int; or int/float when not `integer`), is finite and lies in the
        range."""
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        """The range in interval notation, e.g. "[0, 2]", "(0, 1]", "[1, inf)"."""
        low = "-inf" if self.low is None else _number_text(self.low)
        high = "inf" if self.high is None else _number_text(self.high)
        opening = "(" if self.low_open or self.low is None else "["
        return f"{opening}{low}, {high}{')' if self.high is None else ']'}"


RANGES: dict[str, Range] = {
    "max_tokens": Range(1, integer=True),
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0, low_open=True),
    "top_k": Range(-1, integer=True),
    "min_p": Range(0.0, 1.0),
    "seed": Range(0, 2**63 - 1, integer=True),
    "repetition_penalty": Range(0.0, 2.0**31, low_open=True),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "logprobs": Range(0, MAX_TOP_LOGPROBS, integer=True),
    "prompt_logprobs": Range(0, MAX_TOP_LOGPROBS, integer=True),
}
"""SamplingParams attribute -> allowed values, for every numeric attribute (an optional one may also be None)."""


class InvalidSamplingParam(ValueError):
    """A sampling setting of the wrong type or out of range.

    Attributes:
        field: the SamplingParams attribute at fault.
        problem: what is wrong, without the field's name ("must be in [0, 2], got 3"); str() is
            "<field> <problem>".
    """

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem


@dataclass
class SamplingParams:
    """How one request samples and when it stops (numeric ranges: `RANGES`).

    Attributes:
        max_tokens: number of new tokens to generate (tokens).
        temperature: softmax temperature; 0 (or below GREEDY_TEMPERATURE) means greedy (argmax).
        top_p: nucleus sampling mass.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below min_p * p_max; 0 disables.
        seed: per-request RNG seed; same seed + prompt gives the same output. None: unseeded.
        repetition_penalty: 1 disables (CTRL-style: logits of seen tokens divided/multiplied).
        presence_penalty, frequency_penalty: OpenAI semantics over generated tokens.
        stop: stop strings (at most MAX_STOP_STRINGS, none empty); their text is never returned.
        stop_token_ids: extra token ids that end generation (the token itself is not returned).
        suppress_token_ids: token ids never sampled (their logits are -inf; transformers' `suppress_tokens`).
        ignore_eos: keep generating past the EOS token.
        logprobs: None for none, else the number of top alternatives returned per token.
        prompt_logprobs: None for none, else logprobs of the prompt's own tokens are returned too, with this
            many top alternatives each (the first prompt token has none).
        stream: send deltas as they are produced instead of one final response.
        return_hidden_states: outputs carry each token's layer-0 input embedding and last-layer hidden state, for
            the prompt and every generated token fed back (engine/hidden_states.py; what a talker reads).
        guide_type: constrain the output to a grammar (engine/structured_output.py): one of GUIDE_TYPES, None for
            free text. "json" is any JSON object (a guide given with it is ignored).
        guide: the grammar: a JSON schema (as JSON text), a regex, an EBNF grammar (xgrammar's dialect) or an
            xgrammar structural tag (JSON text: free text with grammars triggered by strings, as tool calls are).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    suppress_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stream: bool = False
    return_hidden_states: bool = False
    guide_type: str | None = None
    guide: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: top_k 1, or a temperature below GREEDY_TEMPERATURE."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self) -> None:
        """Check every field's type and range.

        Raises:
            InvalidSamplingParam: naming the field and its allowed range.
        """
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            if value is None and name in ("seed", "logprobs", "prompt_logprobs"):
                continue
            if not allowed.contains(value):
                kind = "an integer" if allowed.integer else "a finite number"
                raise InvalidSamplingParam(name, f"must be {kind} in {allowed.describe()}, got {value!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidSamplingParam("stop", "must be a string or a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidSamplingParam("stop", f"allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(s == "" for s in self.stop):
            raise InvalidSamplingParam("stop", "strings must not be empty")
        for name in ("stop_token_ids", "suppress_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                    for t in ids):
                raise InvalidSamplingParam(name, "must be a list of integers >= 0")
        for name in ("ignore_eos", "stream", "return_hidden_states"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParam(name, f"must be a boolean, got {getattr(self, name)!r}")
        self._validate_guide()

    def _validate_guide(self) -> None:
        """The guide's kind, presence and size (whether it parses: structured_output.check_guide)."""
        if self.guide_type is None:
            if self.guide is not None:
                raise InvalidSamplingParam("guide", "needs a guide_type")
            return
        if self.guide_type not in GUIDE_TYPES:
            raise InvalidSamplingParam("guide_type", f"must be one of {', '.join(GUIDE_TYPES)}, got "
                                       f"{self.guide_type!r}")
        if self.guide_type == "json":
            return  # any JSON object: a guide given too is ignored, as TensorRT-LLM's backend does
        if not isinstance(self.guide, str) or not self.guide:
            raise InvalidSamplingParam("guide", f"must be a non-empty string for guide_type {self.guide_type}")
        if len(self.guide) > MAX_GUIDE_CHARS:
            raise InvalidSamplingParam("guide", f"is too large: {len(self.guide)} characters, at most "
                                       f"{MAX_GUIDE_CHARS}")

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        """Build from a JSON-like dict (keys as the attribute names; None means default).

        Raises:
            ValueError: unknown key; InvalidSamplingParam: wrong type or out-of-range value.
        """
        if not isinstance(values, dict):
            raise ValueError("sampling parameters must be a JSON object")
        known = cls.__dataclass_fields__
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        given = {k: v for k, v in values.items() if v is not None}
        if isinstance(given.get("stop"), str):
            given["stop"] = [given["stop"]]
        return cls(**given)

    @classmethod
    def from_json(cls, text: str) -> "SamplingParams":
        """Parse the JSON form sent between stages. Raises ValueError on malformed JSON or values."""
        try:
            values = json.loads(text) if text else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"sampling_params is not valid JSON: {exc.msg}") from exc
        return cls.from_dict(values)

    def to_json(self) -> str:
        """JSON form for the `sampling_params` tensor between preprocess and llm."""
        return json.dumps(asdict(self))


def _number_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**63 else repr(value)
