"""OpenAI error objects and the mapping from Triton's errors to HTTP statuses.

Every error leaves the front door as `{"error": {"message", "type", "param", "code"}}` with the status the
OpenAI API uses. Triton errors reach us two ways:

- unary calls (the preprocess stage) raise `InferenceServerException` with a gRPC status: INVALID_ARGUMENT is
  the client's fault (400), UNAVAILABLE means overloaded or not ready (503 + Retry-After), the rest are faults.
- a gRPC stream (the llm stage) carries only the error *message* (Triton 2.51's ModelStreamInferResponse has no
  status code), so `stream_error` classifies it by the llm stage's own wording: the stage answers bad requests
  with INVALID_ARG and a message naming the problem, faults with "llm failed: ..." or "engine step failed", and
  overload ("waiting queue is full ...", its bounded queue) with UNAVAILABLE, answered here as 429.

Either way, Triton 2.51's error for a request to a stage whose Python stub process died ("Stub process
'<model>_0_0' is not healthy.", gRPC INTERNAL on a unary call) is 503 + Retry-After (`stage_down`): the server's
fault, but unavailability (the stage is down; this 2.51 build restarts no stub, see docs/architecture.md
"A dead stage"), not the client's and not a bug to report as 500.
"""

from __future__ import annotations

import re

from omni_backend.ops.metrics import retry_after_s

RETRY_AFTER_S = 1

# Triton input tensor -> the OpenAI field a client sent (for messages that name a tensor).
TENSOR_FIELDS = {
    "text_input": "prompt", "prompt_token_ids": "prompt", "random_seed": "seed", "stop_words": "stop",
}

_QUEUE_FULL = re.compile(r"waiting queue is full", re.I)  # omni_backend.stages.llm.QUEUE_FULL_MESSAGE
_UNAVAILABLE = re.compile(
    r"shutting down|not ready|unavailable|exceeds maximum queue size|overloaded|not admitting new requests", re.I
)
_FAULT = re.compile(r"^(llm|preprocess|postprocess) failed:|engine step failed", re.I)
_CONTEXT = re.compile(r"maximum context length", re.I)
# Triton 2.51 (python_backend) for a request to a model whose stub process died: "Stub process 'llm_0_0' is not
# healthy." (decoupled llm: in the stream's error message; unary stages: gRPC INTERNAL with that message)
STUB_DEAD = re.compile(r"Stub process '(?P<instance>[^']*)' is not healthy|stub process .*not healthy", re.I)


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


def model_not_found(model: str) -> OpenAIError:
    """The one 404 every endpoint answers for an unknown model."""
    return OpenAIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                       "model_not_found")


def unavailable(message: str) -> OpenAIError:
    """503 with Retry-After: Triton is not ready, unreachable, its queue is full, or the llm stage's governor is
    not admitting new requests (its message says for how long; see `omni_backend.ops.metrics.retry_after_s`)."""
    return OpenAIError(503, message, "server_error", None, "service_unavailable",
                       retry_after=retry_after_s(message) or RETRY_AFTER_S)


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


def overloaded(limit: int) -> OpenAIError:
    """429 with Retry-After: the front door's own limit on requests in flight."""
    return OpenAIError(429, f"too many requests in flight (limit {limit}); retry shortly", "rate_limit_error",
                       None, "rate_limit_exceeded", retry_after=RETRY_AFTER_S)


def queue_full(message: str) -> OpenAIError:
    """429 with Retry-After: the llm stage's waiting queue is full (`max_queued_requests`), `message` its words."""
    return OpenAIError(429, message, "rate_limit_error", None, "rate_limit_exceeded", retry_after=RETRY_AFTER_S)


def internal(message: str) -> OpenAIError:
    """500: a real fault in the server."""
    return OpenAIError(500, message, "server_error", None, "internal_error")


def client_error(message: str, prompt_field: str) -> OpenAIError:
    """400 for a Triton stage's INVALID_ARG message, with the field named as the client knows it.

    Args:
        message: the stage's message (it starts with the tensor name when it names one).
        prompt_field: what the prompt is called on this endpoint ("messages" or "prompt").
    """
    message = re.sub(r"^in ensemble '[^']*', ", "", message)
    if _CONTEXT.search(message):
        return invalid(f"{message}; reduce the length of the {prompt_field} or of the completion (max_tokens)",
                       prompt_field, "context_length_exceeded")
    first = re.match(r"[A-Za-z_]+", message)
    param = first.group(0) if first else None
    if param in TENSOR_FIELDS:
        field = prompt_field if TENSOR_FIELDS[param] == "prompt" else TENSOR_FIELDS[param]
        message = field + message[len(param):]
        param = field
        part = _CONTENT_PART.match(message[len(field) + 1:])
        if part:  # an image/audio part preprocess refused: "messages[i].content[j] (type): ..." names the part
            message, param = message[len(field) + 1:], part.group(1)
    elif param not in _KNOWN_FIELDS:
        param = None
    return invalid(message, param)


_CONTENT_PART = re.compile(r"(messages\[\d+\]\.content\[\d+\]) \((?:image_url|input_audio)\)")

_KNOWN_FIELDS = {
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "stop", "logprobs", "ignore_eos", "messages", "prompt",
}


def stream_error(message: str, prompt_field: str) -> OpenAIError:
    """Classify an error that arrived on a gRPC stream (message only; see the module docstring)."""
    if STUB_DEAD.search(message):
        return stage_down(message)
    if _QUEUE_FULL.search(message):
        return queue_full(re.sub(r"^in ensemble '[^']*', ", "", message))
    if _UNAVAILABLE.search(message):
        return unavailable(message)
    if _FAULT.search(message):
        return internal(message)
    return client_error(message, prompt_field)


def grpc_status_error(status: str | None, message: str, prompt_field: str) -> OpenAIError:
    """Map a unary call's gRPC status (as tritonclient spells it, "StatusCode.X") to an OpenAIError."""
    name = (status or "").rsplit(".", 1)[-1]
    if STUB_DEAD.search(message):  # whatever the status (INTERNAL in 2.51): the stage's process died
        return stage_down(message)
    if name == "INVALID_ARGUMENT":
        return client_error(message, prompt_field)
    if name in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"):
        return unavailable(message)
    if name == "NOT_FOUND":
        return unavailable(f"a pipeline model is not loaded: {message}")
    if name == "DEADLINE_EXCEEDED":
        return OpenAIError(504, message, "server_error", None, "timeout")
    if not name and not message.startswith(("preprocess failed", "postprocess failed")):
        return stream_error(message, prompt_field)
    return internal(message)
