"""Per-request sampling settings and their validation.

Ranges follow the OpenAI API reference (temperature [0, 2], presence/frequency penalty [-2, 2], top_logprobs
[0, 20]) and vLLM's `SamplingParams` for the extensions (top_k, min_p, repetition_penalty > 0, CTRL paper,
Keskar et al. 2019).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        max_tokens: number of new tokens to generate, >= 1 (tokens).
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below min_p * p_max; 0 disables.
        seed: per-request RNG seed; same seed + prompt gives the same output. None: unseeded.
        repetition_penalty: > 0; 1 disables (CTRL-style: logits of seen tokens divided/multiplied).
        presence_penalty, frequency_penalty: in [-2, 2], OpenAI semantics over generated tokens.
        stop: stop strings; their text is never returned.
        stop_token_ids: extra token ids that end generation (the token itself is not returned).
        ignore_eos: keep generating past the EOS token.
        logprobs: None for none, else the number of top alternatives (0..20) returned per token.
        stream: send deltas as they are produced instead of one final response.
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
    ignore_eos: bool = False
    logprobs: int | None = None
    stream: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Check every field's type and range.

        Raises:
            ValueError: naming the field and its allowed range.
        """
        _integer("max_tokens", self.max_tokens, low=1)
        _number("temperature", self.temperature, 0.0, 2.0)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _integer("top_k", self.top_k, low=-1)
        _number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _integer("seed", self.seed, low=0, high=2**63 - 1)
        _number("repetition_penalty", self.repetition_penalty, 0.0, 2.0**31, low_open=True)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError("stop_token_ids must be a list of integers")
        for token_id in self.stop_token_ids:
            _integer("stop_token_ids", token_id, low=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError("ignore_eos must be a boolean")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, low=0, high=MAX_TOP_LOGPROBS)
        if not isinstance(self.stream, bool):
            raise ValueError("stream must be a boolean")

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        """Build from a JSON-like dict (keys as the attribute names; None means default).

        Raises:
            ValueError: unknown key, wrong type or out-of-range value.
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
        try:
            return cls(**given)
        except TypeError as exc:  # dataclass signature mismatch
            raise ValueError(str(exc)) from exc

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


def _integer(name: str, value, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {value}")


def _number(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    below = value <= low if low_open else value < low
    if below or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")
