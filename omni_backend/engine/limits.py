"""The context length rule, owned here: a request's prompt plus its completion must fit `max_model_len`.

Preprocess applies it before the llm stage sees a request (with an absent max_tokens meaning "at least one
token"), and the engine applies it to every request it takes; both raise `ContextLengthExceeded`, whose message is
OpenAI's ("This model's maximum context length is ..."), so a client reads the same words whichever refused it.
"""

from __future__ import annotations


class ContextLengthExceeded(ValueError):
    """Prompt + completion longer than max_model_len (the error kind CONTEXT_LENGTH_EXCEEDED, HTTP 400)."""


def check_context_length(max_model_len: int, prompt_tokens: int, max_tokens: int | None) -> None:
    """Raise ContextLengthExceeded unless `prompt_tokens` + `max_tokens` (None: at least 1) <= `max_model_len`."""
    completion = max_tokens if max_tokens is not None else 1
    if prompt_tokens + completion > max_model_len:
        asked = max_tokens if max_tokens is not None else "at least 1"
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens, you requested "
            f"{prompt_tokens + completion} tokens ({prompt_tokens} in the prompt, {asked} for the completion)")
