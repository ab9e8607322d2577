"""Structured outputs at the front door: OpenAI's `response_format` and vLLM's `structured_outputs` as one guide.

The llm engine constrains a request's output to a grammar named by two settings, `guide_type` and `guide`
(the `guided_decoding_guide_type` / `guided_decoding_guide` tensors of TensorRT-LLM's backend;
engine/structured_output.py). This module turns the request fields into them:

- `response_format` (OpenAI): `{"type": "text"}` (free text), `{"type": "json_object"}` (any JSON object: guide
  type `json`), `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}` (the schema;
  `strict` is accepted either way: the output always follows the schema, with no properties beyond those declared).
- `structured_outputs` (vLLM 0.10+): exactly one of `json` (a schema, as an object or JSON text), `regex`,
  `choice` (a list of strings: one of them exactly, an EBNF alternation of their literals), `grammar` (EBNF in
  xgrammar's dialect) or `json_object: true`.

Only the shape is checked here; whether a schema, regex or grammar compiles is checked by preprocess (and the
engine), whose errors name `guided_decoding_guide`: `Guide.rename` gives them back the client's field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from omni_backend.serving.errors import OpenAIError, invalid
from omni_backend.vocabulary import BY_PARAM

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The keys of vLLM's `structured_outputs` that name a grammar (one per request)."""
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
_STAGE_FIELDS = {BY_PARAM[param].openai[0] for param in ("guide_type", "guide")}  # how stage errors name them


@dataclass(frozen=True)
class Guide:
    """A request's grammar: `guide_type` and `guide` as SamplingParams takes them, and `field`, the request field
    it came from (named by its errors)."""

    guide_type: str
    guide: str | None
    field: str

    def settings(self) -> dict[str, Any]:
        """The generation settings (vocabulary names) that carry it."""
        values = {"guide_type": self.guide_type}
        if self.guide is not None:
            values["guide"] = self.guide
        return values

    def rename(self, error: BaseException) -> BaseException:
        """`error` with the client's field where a stage named the guide's tensors, else `error` itself."""
        if not isinstance(error, OpenAIError) or error.param not in _STAGE_FIELDS:
            return error
        return OpenAIError(error.status, self.field + error.message.removeprefix(error.param), error.type,
                           self.field, error.code, error.retry_after)


def requested_guide(response_format: Any, structured_outputs: Any) -> Guide | None:
    """The guide a request asks for, None for free text.

    Raises:
        OpenAIError: 400 naming the field: a response_format or structured_outputs of the wrong shape, an unknown
            type, both given, or none or several grammars in structured_outputs.
    """
    from_format = _response_format(response_format)
    from_outputs = _structured_outputs(structured_outputs)
    if from_format is not None and from_outputs is not None:
        raise invalid("give either response_format or structured_outputs, not both", "structured_outputs")
    return from_format or from_outputs


def _response_format(value: Any) -> Guide | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("response_format must be an object with a 'type'", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json", None, "response_format")
    if kind != "json_schema":
        raise invalid(f"response_format.type must be one of text, json_object, json_schema, got {kind!r}",
                      "response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("response_format.json_schema must be an object with 'name' and 'schema'",
                      "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise invalid("response_format.json_schema.name must be 1 to 64 letters, digits, underscores or dashes",
                      "response_format.json_schema.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
    schema = spec.get("schema")
    if schema is None:
        return Guide("json", None, "response_format.json_schema")
    if not isinstance(schema, dict):
        raise invalid("response_format.json_schema.schema must be a JSON schema object",
                      "response_format.json_schema.schema")
    return Guide("json_schema", json.dumps(schema), "response_format.json_schema.schema")


def _structured_outputs(value: Any) -> Guide | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("structured_outputs must be an object", "structured_outputs")
    given = [k for k in STRUCTURED_KINDS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise invalid(f"structured_outputs must hold exactly one of {', '.join(STRUCTURED_KINDS)}, got "
                      f"{', '.join(given) or 'none'}", "structured_outputs")
    kind = given[0]
    field, item = f"structured_outputs.{kind}", value[kind]
    if kind == "json_object":
        if item is not True:
            raise invalid(f"{field} must be true", field)
        return Guide("json", None, field)
    if kind == "json":
        if isinstance(item, str):
            try:
                item = json.loads(item)
            except json.JSONDecodeError as exc:
                raise invalid(f"{field} is not valid JSON: {exc.msg} at position {exc.pos}", field) from None
        if not isinstance(item, dict):
            raise invalid(f"{field} must be a JSON schema object", field)
        return Guide("json_schema", json.dumps(item), field)
    if kind == "choice":
        if not isinstance(item, list) or not item or not all(isinstance(c, str) and c for c in item):
            raise invalid(f"{field} must be a non-empty list of non-empty strings", field)
        # EBNF string literals take JSON's escapes (quotes, backslashes, \n, \uXXXX)
        return Guide("ebnf_grammar", "root ::= " + " | ".join(json.dumps(c) for c in item), field)
    if not isinstance(item, str) or not item:
        raise invalid(f"{field} must be a non-empty string", field)
    return Guide("regex" if kind == "regex" else "ebnf_grammar", item, field)
