"""The llm model's tensors: a request's input arrays to engine values, an engine output to response arrays.

Pure numpy, so the whole mapping is tested without a server; `model_repository/llm/1/model.py` only moves the
arrays in and out of Triton.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from omni_backend import tensor_names as T
from omni_backend.engine.llm_engine import RequestOutput, TokenLogprob
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import PromptEmbeds, PromptPositions
from omni_backend.operator_key import ADMIN_KEY_HEADER
from omni_backend.stages.tensors import one_value, string_tensor
from omni_backend.vocabulary import FieldError

INPUT_NAMES = (T.INPUT_IDS, T.SAMPLING_PARAMS, T.RESET_PREFIX_CACHE, T.STREAM_KEY, T.CANCEL, T.PROMPT_EMBEDS,
               T.PROMPT_EMBED_POSITIONS, T.PROMPT_POSITIONS)
"""The llm model's inputs (all optional in its config: which are given tells a generation from a reset or a
cancel)."""


def is_reset_request(arrays: dict) -> bool:
    """Whether the llm model's input arrays (input name -> numpy array, the `INPUT_NAMES` present) are an
    operator's prefix cache reset: `reset_prefix_cache` BOOL [1] true.

    Raises:
        FieldError: `reset_prefix_cache` true together with a generation input (a reset is a request of its own).
    """
    if not one_value(arrays, T.RESET_PREFIX_CACHE, bool, False):
        return False
    given = [name for name in (T.INPUT_IDS, T.SAMPLING_PARAMS) if name in arrays]
    if given:
        raise FieldError(T.RESET_PREFIX_CACHE, f"is a request of its own: send it without {' and '.join(given)}")
    return True


def cancel_key(arrays: dict) -> str | None:
    """The key of a cancel request (`cancel` STRING [1]: the `stream_key` of the generation to end), None for any
    other request. The streaming entry points (stages/entry_points.py) end their llm generations this way, because
    python_backend 24.10 cannot cancel a request a Python model sent.

    Raises:
        FieldError: `cancel` together with a generation input (a cancel is a request of its own), or not one UTF-8
            string.
    """
    key = one_value(arrays, T.CANCEL, str)
    if key is None:
        return None
    given = [name for name in (T.INPUT_IDS, T.SAMPLING_PARAMS, T.STREAM_KEY) if name in arrays]
    if given:
        raise FieldError(T.CANCEL, f"is a request of its own: send it without {' and '.join(given)}")
    return key


def generation_inputs(arrays: dict) -> tuple[list[int], SamplingParams, PromptEmbeds | None,
                                              PromptPositions | None]:
    """A generation request's prompt token ids, sampling parameters, prompt embeddings and M-RoPE position ids from
    the llm model's input arrays: `input_ids` INT32 [n], `sampling_params` STRING [1] (the JSON of a
    SamplingParams), optionally together `prompt_embeds` FP32 [k, hidden] + `prompt_embed_positions` INT32 [k]
    (k = 0: none, a text-only request through omni_chat_mm), and optionally `prompt_positions` INT32 [3, n] ([3, 0]:
    none). The engine checks the embeddings' and the ids' shapes against the model (`LLMEngine.make_sequence`).

    `input_ids` and `sampling_params` are optional in the model's config only so that a reset request
    (`is_reset_request`) can go without them.

    Raises:
        FieldError: `input_ids` or `sampling_params` missing, `sampling_params` not one UTF-8 string, or only one of
            the two embedding inputs.
        ValueError: `sampling_params` that SamplingParams.from_json refuses.
    """
    for name in (T.INPUT_IDS, T.SAMPLING_PARAMS):
        if name not in arrays:
            raise FieldError(name, "is required (a generation request takes input_ids and sampling_params)")
    ids = np.asarray(arrays[T.INPUT_IDS]).reshape(-1).tolist()
    params = SamplingParams.from_json(one_value(arrays, T.SAMPLING_PARAMS, str))
    embeds, positions = arrays.get(T.PROMPT_EMBEDS), arrays.get(T.PROMPT_EMBED_POSITIONS)
    if (embeds is None) != (positions is None):
        missing, given = (T.PROMPT_EMBEDS, T.PROMPT_EMBED_POSITIONS) if embeds is None else \
            (T.PROMPT_EMBED_POSITIONS, T.PROMPT_EMBEDS)
        raise FieldError(missing, f"is required with {given}")
    rope = arrays.get(T.PROMPT_POSITIONS)
    rope = None if rope is None or rope.size == 0 else PromptPositions(torch.from_numpy(np.asarray(rope, np.int64)))
    if positions is None or positions.size == 0:
        return ids, params, None, rope
    return ids, params, PromptEmbeds(torch.from_numpy(np.asarray(positions).astype(np.int64).reshape(-1)),
                                     torch.from_numpy(np.array(embeds, dtype=np.float32))), rope


def output_arrays(output: RequestOutput) -> dict[str, np.ndarray]:
    """One response's output arrays for an engine output; with `hidden_states` and `input_embeds` FP32 [k, H] when
    the request asked for them (`SamplingParams.return_hidden_states`: a spoken answer's talker reads them)."""
    arrays = {
        T.TEXT_OUTPUT: string_tensor(output.text),
        T.OUTPUT_IDS: np.array(output.token_ids, dtype=np.int32),
        T.FINISH_REASON: string_tensor(output.finish_reason or ""),
        T.PROMPT_TOKENS: np.array([output.prompt_tokens], dtype=np.int32),
        T.COMPLETION_TOKENS: np.array([output.completion_tokens], dtype=np.int32),
        T.CACHED_TOKENS: np.array([output.cached_tokens], dtype=np.int32),
        T.OUTPUT_LOGPROBS: string_tensor(logprobs_json(output.logprobs)),
        T.PROMPT_TOKEN_LOGPROBS: string_tensor(logprobs_json(output.prompt_logprobs)),
    }
    if output.hidden_states is not None:
        arrays[T.HIDDEN_STATES] = output.hidden_states.detach().float().cpu().numpy()
        arrays[T.INPUT_EMBEDS] = output.input_embeds.detach().float().cpu().numpy()
    return arrays


def reset_arrays(dropped_blocks: int) -> dict[str, np.ndarray]:
    """The one response of a prefix cache reset."""
    return {T.DROPPED_BLOCKS: np.array([dropped_blocks], dtype=np.int32)}


def logprobs_json(entries: list[TokenLogprob] | None) -> str:
    """Token logprobs as the postprocess stage takes them ("" for none)."""
    if not entries:
        return ""
    return json.dumps([{"id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in entries])


class OutputSink:
    """A request's `outputs.ResponseSink` over its stream (`triton_glue.StreamSender`): each engine output as the
    llm model's response arrays."""

    def __init__(self, sender):
        self.sender = sender

    def send(self, output: RequestOutput) -> None:
        self.sender.send(output_arrays(output), final=output.finished)

    def fail(self, error: BaseException) -> None:
        self.sender.fail(error)

    def close(self) -> None:
        self.sender.close()

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


def serve_request(service, arrays: dict, request_parameters: dict, request_id: str, sender) -> None:
    """Everything the llm model does with one request: an operator's reset (answered here, after the engine loop
    did it: at most one step), a cancel by key (`cancel_key`: the generation it names ends as a cancelled client's
    does, and this request gets the final flag alone), or a generation handed to `service` (`LLMService`), under its
    `stream_key` when it has one; any refusal or fault ends only this request's stream with its error.

    Args:
        service: the stage's LLMService.
        arrays: the request's input arrays (`INPUT_NAMES`).
        request_parameters: the request's parameters (Triton's `request.parameters()`, decoded JSON).
        request_id: unique id for the engine, used when the request has no `stream_key`.
        sender: the request's stream (`triton_glue.StreamSender`).
    """
    try:
        if is_reset_request(arrays):
            dropped = service.reset_prefix_cache_as_operator(request_parameters.get(ADMIN_KEY_HEADER))
            sender.send(reset_arrays(dropped), final=True)
            return
        key = cancel_key(arrays)
        if key is not None:
            service.cancel(key)
            sender.close()
            return
        ids, params, embeds, rope = generation_inputs(arrays)
        service.submit(one_value(arrays, T.STREAM_KEY, str) or request_id, ids, params, OutputSink(sender),
                       prompt_embeds=embeds, prompt_positions=rope)
    except Exception as exc:  # bad input, refused (too hot, queue full), or a fault: this request only
        sender.fail(exc)
