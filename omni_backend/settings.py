"""Settings declared once: a dataclass field per setting, carrying its type, default, allowed values and doc.

A config dataclass (the engine's `EngineConfig`, the llm stage's `LLMStageSettings`, the governor's
`GovernorConfig`, ...) declares each field with `setting(...)`. From that one declaration come the checks of a
value (`check`), the parsing of the strings a Triton `config.pbtxt` or an environment variable holds
(`from_strings`, `parse_text`: the only string parser), the strings a model repository is rendered with
(`to_strings`) and the operator's table in docs/operations.md (`markdown_rows`). The same shape as vLLM's
`EngineArgs` (one dataclass from which the CLI and the config are derived).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

_METADATA_KEY = "omni_setting"


@dataclass(frozen=True)
class Spec:
    """What one setting may hold, and what it is for.

    Attributes:
        doc: one line for operators (units, what 0 or empty means).
        kind: bool, int, float or str.
        low, high: inclusive bounds of a number (None: unbounded); `low_open` excludes `low` ("(0, 1]").
        choices: the allowed values (None: any).
        pattern: a regular expression a string must match in full (None: any), described to people by `forms`.
        forms: the allowed values in words, for a pattern ("auto, cpu, cuda or cuda:N").
        optional: None (rendered as "") is allowed and means "derived at run time".
        operator: the server's operators set it (`OMNI_<NAME>`, rendered into the model repository); False for
            settings only code sets (tests, offline engines).
        name: the operator's name when it differs from the field's (`model_path` -> `llm_model_path`).
    """

    doc: str
    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple | None = None
    pattern: str | None = None
    forms: str | None = None
    optional: bool = False
    operator: bool = True
    name: str | None = None

    def allowed(self) -> str:
        """The allowed values in words ("one of a, b", "an integer >= 0", "a number in (0, 1]")."""
        if self.kind is bool:
            return "true or false"
        if self.choices is not None:
            return "one of " + ", ".join(str(choice) for choice in self.choices)
        if self.pattern is not None:
            return self.forms or f"a string matching {self.pattern}"
        if self.kind is str:
            return "a string"
        noun = "an integer" if self.kind is int else "a number"
        if self.low is not None and self.high is not None:
            return f"{noun} in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}]"
        if self.low is not None:
            return f"{noun} {'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{noun} <= {_num(self.high)}"
        return noun

    def problem(self, value: Any) -> str | None:
        """What is wrong with a (parsed) value, or None."""
        if value is None:
            return None if self.optional else f"must be {self.allowed()}, got None"
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else:
            ok = isinstance(value, str)
        if ok and self.kind in (int, float):
            ok = (self.low is None or value > self.low or (value == self.low and not self.low_open)) and \
                 (self.high is None or value <= self.high)
        if ok and self.choices is not None:
            ok = value in self.choices
        if ok and self.pattern is not None:
            ok = re.fullmatch(self.pattern, value) is not None
        return None if ok else f"must be {self.allowed()}, got {value!r}"


def setting(default: Any, doc: str, *, kind: type | None = None, **spec: Any) -> Any:
    """A dataclass field declaring one setting (`Spec`'s attributes as keywords; `kind` defaults to the type of
    `default`).

    Raises:
        TypeError: no kind can be told (a None default without `kind`).
    """
    kind = kind or type(default)
    if kind not in (bool, int, float, str):
        raise TypeError(f"a setting is a bool, int, float or str, not {kind.__name__}")
    return dataclasses.field(default=default, metadata={_METADATA_KEY: Spec(doc, kind, **spec)})


def declared(cls) -> list[tuple[dataclasses.Field, Spec]]:
    """The fields of dataclass `cls` declared with `setting`, in order, with their specs."""
    return [(f, f.metadata[_METADATA_KEY]) for f in dataclasses.fields(cls) if _METADATA_KEY in f.metadata]


def operator_name(f: dataclasses.Field, spec: Spec, prefix: str = "") -> str:
    """The name operators use for a setting (`OMNI_<NAME>` in upper case): its spec's name, else the prefixed field
    name."""
    return spec.name or prefix + f.name


def config_parameters(config: dict) -> dict[str, str]:
    """A Triton model config's `parameters` (the config as JSON: what a Python model gets in
    `args["model_config"]`, or what `get_model_config` answers) as name -> string value."""
    return {name: value.get("string_value", "") for name, value in config.get("parameters", {}).items()}


def parse_text(text: str, spec: Spec, name: str) -> Any:
    """A setting's value from its text (a Triton string parameter, an environment variable): booleans are true,
    false, 1 or 0 in any case; numbers are decimal; "" is None for an optional setting.

    Raises:
        ValueError: text that is not the setting's kind, or a value outside what the setting allows (naming it).
    """
    stripped = text.strip()
    if stripped == "" and spec.optional:
        return None
    if spec.kind is bool:
        value: Any = {"true": True, "1": True, "false": False, "0": False}.get(stripped.lower())
    elif spec.kind is int:
        value = int(stripped) if re.fullmatch(r"[+-]?\d+", stripped) else None
    elif spec.kind is float:
        try:
            value = float(stripped)
        except ValueError:
            value = None
    else:
        value = text
    if value is None or spec.problem(value):
        raise ValueError(f"setting {name} must be {spec.allowed()}, got {text!r}")
    return value


def parse_field(cls, field_name: str, text: str | None, key: str | None = None) -> Any:
    """The value of one declared field of `cls` from its text (`parse_text`; None or "": its default), for a stage
    that reads a setting declared elsewhere (preprocess reads the engine's `max_model_len`); `key` names it in
    errors (default: the field's name).

    Raises:
        KeyError: `cls` declares no such setting; ValueError: what `parse_text` raises.
    """
    f, spec = {f.name: (f, spec) for f, spec in declared(cls)}[field_name]
    if text is None or (text.strip() == "" and not spec.optional):
        return f.default
    return parse_text(text, spec, key or field_name)


def check(instance) -> None:
    """Check every declared field of a dataclass instance; numbers given as int where a float is declared become
    floats. Call it from `__post_init__`.

    Raises:
        ValueError: the first field whose value the setting does not allow, naming it.
    """
    for f, spec in declared(type(instance)):
        value = getattr(instance, f.name)
        problem = spec.problem(value)
        if problem:
            raise ValueError(f"setting {f.name} {problem}")
        if spec.kind is float and isinstance(value, int):
            object.__setattr__(instance, f.name, float(value))


def from_strings(cls, strings: dict[str, str], prefix: str = "", **given: Any):
    """An instance of `cls` from string values keyed by `prefix` + field name; absent keys and "" (for settings
    that are not optional) keep the default; `given` values are passed as they are.

    Raises:
        ValueError: a value `parse_text` refuses, or what `cls` itself refuses.
    """
    return _parse_group(cls, strings, {f.name: prefix + f.name for f, _ in declared(cls)}, given)


def from_environ(cls, environ, prefix: str = ""):
    """An instance of `cls` from the `OMNI_<NAME>` variables in `environ` (NAME: each setting's `operator_name`
    with `prefix`, upper case); unset variables and "" (for settings that are not optional) keep the default.

    Raises:
        ValueError: a value `parse_text` refuses (naming the setting as operators do), or what `cls` refuses.
    """
    keys = {f.name: operator_name(f, spec, prefix) for f, spec in declared(cls)}
    return _parse_group(cls, {key: environ.get("OMNI_" + key.upper()) for key in keys.values()}, keys, {})


def _parse_group(cls, strings: dict[str, str | None], keys: dict[str, str], given: dict[str, Any]):
    """`cls` from `strings`, each field's text under `keys[field name]` (the name its errors give), and `given`."""
    values = dict(given)
    for f, spec in declared(cls):
        key = keys[f.name]
        text = strings.get(key)
        if text is None or (text.strip() == "" and not spec.optional) or f.name in given:
            continue
        values[f.name] = parse_text(text, spec, key)
    return cls(**values)


def to_text(value: Any) -> str:
    """A setting's value as text: booleans as true/false, None as ""."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def to_strings(instance, prefix: str = "") -> dict[str, str]:
    """`prefix` + field name -> text (`to_text`) for every declared field of a dataclass instance."""
    return {prefix + f.name: to_text(getattr(instance, f.name)) for f, _ in declared(type(instance))}


class SettingGroup:
    """Base of a dataclass whose fields are settings: its values are checked when it is made (`check`; a subclass
    with rules between fields calls `super().__post_init__()` first), and `from_strings` parses a stage's string
    parameters into one. `PREFIX` starts the operators' names of its settings (`OMNI_GOVERNOR_<FIELD>` for
    `GovernorConfig`'s); a stage's own config names them by field, except where several groups share one config
    (the llm's: `governor_<field>` there)."""

    PREFIX: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check(self)

    @classmethod
    def from_strings(cls, strings: dict[str, str], prefix: str = "", **given: Any):
        """An instance from string values keyed by `prefix` + field name (module function `from_strings`).

        Raises:
            ValueError: a value a setting does not allow, or a broken rule between fields, naming it.
        """
        return from_strings(cls, strings, prefix, **given)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
