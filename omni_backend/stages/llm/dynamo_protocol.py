"""What a Dynamo LLM worker receives and sends: Dynamo's preprocessed request (token ids in) mapped to our engine's
`SamplingParams`, and our `RequestOutput`s mapped to Dynamo's engine output chunks (token ids out).

The request is the JSON form of Dynamo's `PreprocessedRequest` (lib/llm/src/protocols/common/preprocessor.rs in
ai-dynamo 1.6; the same keys `dynamo.common.backend.engine.GenerateRequest` documents): `token_ids`,
`stop_conditions` {max_tokens, stop, stop_token_ids_hidden, min_tokens, ignore_eos, max_thinking_tokens},
`sampling_options` {n, temperature, top_p, top_k, min_p, seed, repetition_penalty, presence_penalty,
frequency_penalty, guided_decoding, ...}, `output_options` {logprobs, prompt_logprobs, ...} and `eos_token_ids`.
The frontend tokenizes, applies the chat template, detokenizes and applies stop strings itself (vLLM's Dynamo
worker drops `stop` as well), so only token-level conditions reach the engine.

A chunk is Dynamo's `LLMEngineOutput`: `token_ids` (the new ones), and on the last chunk `finish_reason` ("stop",
"length"; "abort" is read as cancelled by Dynamo's Rust layer) and `completion_usage` {prompt_tokens,
completion_tokens, total_tokens, prompt_tokens_details: {cached_tokens}}, which the frontend returns as the OpenAI
`usage` (cached_tokens: the prompt tokens our prefix cache supplied).

What this worker does not do is refused with a ValueError naming the field (the worker answers 400), never
ignored: several choices (n > 1), guided decoding, log probabilities, min_tokens.
"""

from __future__ import annotations

from typing import Any

from omni_backend.engine.llm_engine import RequestOutput
from omni_backend.engine.sampling_params import SamplingParams

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
"""`sampling_options` keys that are our SamplingParams fields under the same name and meaning."""


def _section(request: dict, name: str) -> dict:
    value = request.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, got {type(value).__name__}")  # noqa: TRY004 (a 400)
    return value


def _refuse_set(section: dict, name: str, keys: tuple[str, ...], why: str) -> None:
    """ValueError when one of `keys` of `section` holds a value that asks for something (not None, 0, false or
    empty)."""
    for key in keys:
        if section.get(key) not in (None, 0, False, [], {}):
            raise ValueError(f"{name}.{key} is not supported by this worker ({why})")


def prompt_token_ids(request: dict) -> list[int]:
    """The request's prompt (`token_ids`).

    Raises:
        ValueError: missing, empty or not a list of integers (the engine checks the vocabulary range).
    """
    ids = request.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("token_ids must be a non-empty list of integers")
    return ids


def sampling_params(request: dict, max_model_len: int) -> SamplingParams:
    """Our SamplingParams for a preprocessed request (streamed; `max_tokens` absent: up to `max_model_len`).

    `eos_token_ids` the frontend read from the model folder, and `stop_token_ids_hidden`, end generation (unless
    `ignore_eos`) without being returned, as our `stop_token_ids` do.

    Raises:
        ValueError: an option this worker does not support (module docstring), or a value SamplingParams refuses
            (InvalidSamplingParam, naming the field).
    """
    prompt = prompt_token_ids(request)
    stop = _section(request, "stop_conditions")
    sampling = _section(request, "sampling_options")
    output = _section(request, "output_options")
    if sampling.get("n") not in (None, 1):
        raise ValueError(f"sampling_options.n must be 1 on this worker, got {sampling['n']!r}")
    _refuse_set(sampling, "sampling_options", ("guided_decoding", "use_beam_search"), "no such decoding here")
    _refuse_set(output, "output_options", ("logprobs", "prompt_logprobs"), "no log probabilities in its chunks")
    _refuse_set(stop, "stop_conditions", ("min_tokens",), "the engine has no minimum length")
    ignore_eos = bool(stop.get("ignore_eos") or False)
    stop_ids = list(stop.get("stop_token_ids_hidden") or [])
    if not ignore_eos:
        stop_ids += [t for t in request.get("eos_token_ids") or [] if t not in stop_ids]
    max_tokens = stop.get("max_tokens")
    values: dict[str, Any] = {key: sampling[key] for key in SAMPLING_KEYS if sampling.get(key) is not None}
    return SamplingParams(**values, max_tokens=max(1, max_model_len - len(prompt)) if max_tokens is None
                          else max_tokens, stop_token_ids=stop_ids, ignore_eos=ignore_eos, stream=True)


def usage(output: RequestOutput) -> dict:
    """Dynamo's `completion_usage` (OpenAI's `usage`) from a request's final output."""
    return {"prompt_tokens": output.prompt_tokens, "completion_tokens": output.completion_tokens,
            "total_tokens": output.prompt_tokens + output.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": output.cached_tokens}}


def chunk(output: RequestOutput) -> dict:
    """Dynamo's engine output for one of our outputs: its new token ids, and on the final one the finish reason
    and usage."""
    response: dict[str, Any] = {"token_ids": list(output.token_ids), "index": 0}
    if output.finished:  # Dynamo's LLMEngineOutput fields, not the Triton tensor of the same name
        response.update(finish_reason=output.finish_reason, completion_usage=usage(output))
    return response


def health_check_payload(bos_token_id: int) -> dict:
    """The canary request Dynamo's health checker sends to an idle worker (DYN_HEALTH_CHECK_ENABLED): one token
    of a one-token prompt, greedy."""
    return {"token_ids": [bos_token_id], "stop_conditions": {"max_tokens": 1, "ignore_eos": True},
            "sampling_options": {"temperature": 0.0}}
