"""OpenAI error objects, and the one mapping from Triton's errors to them.

Every error leaves the front door as `{"error": {"message", "type", "param", "code"}}` with the status the
OpenAI API uses. A stage's error reaches the front door as a message (gRPC streams carry nothing else in Triton
2.51) whose header names its kind and field (`omni_backend.vocabulary.StageError`); `from_triton` reads that
header, so the status is the kind's, never a guess from the wording. Messages without a header are Triton's own:
its words for a stage whose Python stub process died ("Stub process '<model>_0_0' is not healthy.": this 2.51
build restarts no stub, docs/operations.md "Triton 2.51 workarounds") become 503 + Retry-After naming the stage;
the rest take their gRPC status (INVALID_ARGUMENT 400, UNAVAILABLE 503, NOT_FOUND 503, DEADLINE_EXCEEDED 504). On a
stream, where there is no status, Triton's words for a model it is not serving (unloaded at shutdown, not
ready, its queue full) are 503 (`TRITON_UNAVAILABLE`), and anything else is a fault (500): the front door built
the request, so Triton refusing it is not the client's doing.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

from omni_backend.vocabulary import ErrorKind, StageError, openai_param

RETRY_AFTER_S = 1

# Triton 2.51 (python_backend) for a request to a model whose stub process died: "Stub process 'llm_0_0' is not
# healthy." (decoupled llm: in the stream's error message; unary stages: gRPC INTERNAL with that message)
STUB_DEAD = re.compile(r"Stub process '(?P<instance>[^']*)' is not healthy|stub process .*not healthy", re.I)
# Triton 2.51's own words for a model it is not serving (no status reaches a stream's client): unloaded during
# shutdown ("Request for unknown model: 'llm' has no available versions"), not ready, its queue full.
TRITON_UNAVAILABLE = re.compile(r"has no available versions|is not ready|exceeds maximum queue size|"
                                r"Server is shutting down|unavailable", re.I)
# gRPC statuses of a tritonserver that cannot take a call now: down, unreachable, shutting down, out of resources
UNAVAILABLE_STATUSES = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
_ENSEMBLE_PREFIX = re.compile(r"^(?:in ensemble '[^']*', )+")


class OpenAIError(Exception):
    """An error answer: HTTP status plus the OpenAI error object's fields.

    Args:
        status: HTTP status code.
        message: human-readable, names the offending field where there is one.
        type: OpenAI error type ("invalid_request_error", "authentication_error", "server_error", ...).
        param: the request field at fault, or None.
        code: machine-readable code ("model_not_found", "context_length_exceeded", ...), or None.
        retry_after: seconds for a Retry-After header (429/503), or None.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """400 invalid_request_error."""
    return OpenAIError(400, message, "invalid_request_error", param, code)


def required_text(body: dict, field: str) -> str:
    """`body[field]` as a non-blank string. Raises OpenAIError 400 naming `field` otherwise."""
    value = body.get(field)
    if not isinstance(value, str):
        raise invalid(f"'{field}' is a required property and must be a string", field)
    if not value.strip():
        raise invalid(f"{field} must not be empty", field)
    return value


def integral(value: Any) -> Any:
    """A float without a fraction (16.0) as its int (JSON has one number type, and JSON Schema counts 16.0 as an
    integer); any other value as it is, for the strict check to judge."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def number(body: dict, field: str, kind: type, default):
    """`body[field]` as a `kind` (int: a JSON integer, 2.0 included; float: any finite JSON number), `default` when
    absent or null. Raises OpenAIError 400 naming `field` for another type (a string, a boolean) or a non-finite
    number."""
    value = integral(body.get(field)) if kind is int else body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        raise invalid(f"{field} must be {'an integer' if kind is int else 'a number'}, got {value!r}", field)
    if kind is float and not math.isfinite(value):
        raise invalid(f"{field} must be a finite number", field)
    return kind(value)


def model_not_found(model: str) -> OpenAIError:
    """The one 404 every endpoint answers for an unknown model."""
    return OpenAIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                       "model_not_found")


def unavailable(message: str, retry_after: int | None = None) -> OpenAIError:
    """503 with Retry-After (`retry_after` seconds, default RETRY_AFTER_S): Triton is not ready or unreachable,
    a stage is down, or the llm stage's governor is not admitting new requests."""
    return OpenAIError(503, message, "server_error", None, "service_unavailable",
                       retry_after=retry_after or RETRY_AFTER_S)


def server_unavailable(detail: str, server: tuple[str, str] | None = None) -> OpenAIError:
    """503 + Retry-After: a tritonserver cannot take calls (down, unreachable, shutting down or out of resources;
    `detail`: gRPC's or Triton's words). `server`: (stage, grpc_url) of a stage on a tritonserver of its own, named
    in the message (only the requests that need that stage get it); None: the front door's own Triton."""
    if server is None:
        return unavailable(f"Triton is unavailable: {detail}")
    stage, grpc_url = server
    return unavailable(f"the {stage} stage is unavailable (its tritonserver at {grpc_url}): {detail}")


def call_failed(status: str, detail: str, model: str, server: tuple[str, str] | None = None) -> OpenAIError:
    """The OpenAIError for a gRPC call to `model` that failed as a whole, no stage having answered it (`status`:
    gRPC's status name, `detail` its words): `server_unavailable` for UNAVAILABLE_STATUSES, 504 for
    DEADLINE_EXCEEDED (as `from_triton`), else 500."""
    if status in UNAVAILABLE_STATUSES:
        return server_unavailable(detail, server)
    if status == "DEADLINE_EXCEEDED":
        return timed_out(f"the {model} call timed out: {detail}")
    return internal(f"the {model} call failed: {status}: {detail}")


def overloaded(limit: int) -> OpenAIError:
    """429 with Retry-After: the front door's own limit on requests in flight."""
    return OpenAIError(429, f"too many requests in flight (limit {limit}); retry shortly", "rate_limit_error",
                       None, "rate_limit_exceeded", retry_after=RETRY_AFTER_S)


def timed_out(message: str) -> OpenAIError:
    """504: Triton gave up on the request at its deadline (gRPC DEADLINE_EXCEEDED)."""
    return OpenAIError(504, message, "server_error", None, "timeout")


def internal(message: str) -> OpenAIError:
    """500: a real fault in the server."""
    return OpenAIError(500, message, "server_error", None, "internal_error")


def dead_stage(message: str) -> str | None:
    """The model whose stub died when `message` is Triton's "Stub process '<model>_<i>_<j>' is not healthy."
    ("" when it names none), else None."""
    match = STUB_DEAD.search(message)
    if match is None:
        return None
    return re.sub(r"_[0-9]+_[0-9]+$", "", match.group("instance") or "")


def stage_down(message: str) -> OpenAIError:
    """503 with Retry-After for Triton's "Stub process '<model>_<i>_<j>' is not healthy." (`message` holds it):
    names the stage, keeps Triton's words."""
    model = dead_stage(message)
    stage = f"the {model} stage" if model else "a pipeline stage"
    return unavailable(f"{stage} is down (its process died): {message}")


def from_stage(error: StageError, param_for: Callable[[str], str], prompt_field: str | None) -> OpenAIError:
    """The OpenAIError for a stage's error of a known kind.

    Args:
        error: the parsed StageError.
        param_for: the client's name for a stage's field (`text_input[0].content[1]` -> `messages[0].content[1]`).
        prompt_field: what the prompt is called on this endpoint ("messages", "prompt"), named by
            CONTEXT_LENGTH_EXCEEDED; None where there is no prompt.
    """
    kind = error.kind
    if kind is ErrorKind.CONTEXT_LENGTH_EXCEEDED:
        advice = f"; reduce the length of the {prompt_field} or of the completion (max_tokens)" if prompt_field else ""
        return invalid(error.message + advice, prompt_field, "context_length_exceeded")
    if kind is ErrorKind.INVALID_ARGUMENT:
        if error.field is None:
            return invalid(error.message)
        param = param_for(error.field)
        return invalid(param + error.message.removeprefix(error.field), param)
    if kind is ErrorKind.QUEUE_FULL:
        return OpenAIError(429, error.message, "rate_limit_error", None, "rate_limit_exceeded",
                           retry_after=error.retry_after_s or RETRY_AFTER_S)
    if kind in (ErrorKind.NOT_ADMITTING, ErrorKind.UNAVAILABLE):
        return unavailable(error.message, error.retry_after_s)
    return internal(error.message)


def from_triton(message: str, grpc_status: str | None = None, prompt_field: str | None = "prompt",
                param_for: Callable[[str], str] | None = None,
                server: tuple[str, str] | None = None) -> OpenAIError:
    """The OpenAIError for an error Triton returned (see the module docstring).

    Args:
        message: the error's message (a unary call's `exc.message()`, a stream's error message).
        grpc_status: a unary call's status as tritonclient spells it ("StatusCode.INVALID_ARGUMENT"); None on a
            stream.
        prompt_field: the endpoint's name for the prompt (see `from_stage`).
        param_for: the client's name for a stage's field; default: the generation vocabulary's
            (`vocabulary.openai_param` with `prompt_field`).
        server: the stage and gRPC address the call went to when not the front door's own Triton
            (`server_unavailable` names them).
    """
    if STUB_DEAD.search(message):  # whatever the status (INTERNAL in 2.51): the stage's process died
        return stage_down(message)
    error = StageError.parse(message)
    if error is not None:
        return from_stage(error, param_for or (lambda field: openai_param(field, prompt_field or "prompt")),
                          prompt_field)
    message = _ENSEMBLE_PREFIX.sub("", message)
    name = (grpc_status or "").rsplit(".", 1)[-1]
    if name == "INVALID_ARGUMENT":
        return invalid(message)
    if name in UNAVAILABLE_STATUSES:
        return server_unavailable(message, server)
    if name == "NOT_FOUND" or (not name and "has no available versions" in message):
        return unavailable(f"a pipeline model is not loaded: {message}")
    if name == "DEADLINE_EXCEEDED":
        return timed_out(message)
    if not name and TRITON_UNAVAILABLE.search(message):
        return unavailable(message)
    return internal(message)
