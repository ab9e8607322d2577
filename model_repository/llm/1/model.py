"""Triton glue for the decoupled llm stage; the engine and its threads live in omni_backend."""

import json
import uuid

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from omni_backend.engine.sequence import PromptEmbeds
from omni_backend.launch.tritonserver import ADMIN_KEY_HEADER
from omni_backend.stages.llm import INPUT_NAMES, cancel_key, create_service, generation_inputs, is_reset_request
from omni_backend.stages.tensors import one_value, request_arrays, triton_error
from omni_backend.vocabulary import StageError


class _Sink:
    """Sends one request's outputs through its Triton response sender."""

    def __init__(self, sender):
        self.sender = sender

    def send(self, output):
        logprobs = _logprobs_json(output.logprobs)
        prompt_logprobs = _logprobs_json(output.prompt_logprobs)
        tensors = [
            pb_utils.Tensor("text_output", np.array([output.text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("output_ids", np.array(output.token_ids, dtype=np.int32)),
            pb_utils.Tensor("finish_reason", np.array([(output.finish_reason or "").encode()], dtype=np.object_)),
            pb_utils.Tensor("prompt_tokens", np.array([output.prompt_tokens], dtype=np.int32)),
            pb_utils.Tensor("completion_tokens", np.array([output.completion_tokens], dtype=np.int32)),
            pb_utils.Tensor("cached_tokens", np.array([output.cached_tokens], dtype=np.int32)),
            pb_utils.Tensor("output_logprobs", np.array([logprobs.encode()], dtype=np.object_)),
            pb_utils.Tensor("prompt_token_logprobs", np.array([prompt_logprobs.encode()], dtype=np.object_)),
        ]
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if output.finished else 0
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)

    def send_dropped_blocks(self, dropped):
        """The one response of a prefix cache reset."""
        tensor = pb_utils.Tensor("dropped_blocks", np.array([dropped], dtype=np.int32))
        self.sender.send(pb_utils.InferenceResponse(output_tensors=[tensor]),
                         flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def fail(self, error):
        self.sender.send(pb_utils.InferenceResponse(error=triton_error(pb_utils, error, "llm")),
                         flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def close(self):
        self.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self):
        return self.sender.is_cancelled()


def _logprobs_json(entries):
    """Token logprobs as the postprocess stage takes them ("" for none)."""
    if not entries:
        return ""
    return json.dumps([{"id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in entries])


def _prompt_embeds(request, hidden_size):
    """The optional `prompt_embeds` + `prompt_embed_positions` inputs as a PromptEmbeds (None when absent)."""
    embeds = pb_utils.get_input_tensor_by_name(request, "prompt_embeds")
    positions = pb_utils.get_input_tensor_by_name(request, "prompt_embed_positions")
    if embeds is None and positions is None:
        return None
    if embeds is None or positions is None:
        raise ValueError("prompt_embeds and prompt_embed_positions must be given together")
    if positions.as_numpy().size == 0:  # a text-only request through omni_chat_mm
        return None
    if embeds.as_numpy().ndim != 2 or embeds.as_numpy().shape[1] != hidden_size:
        raise ValueError(f"prompt_embeds must be [k, {hidden_size}] (the model's hidden size), "
                         f"got {list(embeds.as_numpy().shape)}")
    return PromptEmbeds(torch.from_numpy(positions.as_numpy().astype(np.int64).reshape(-1)),
                        torch.from_numpy(np.array(embeds.as_numpy(), dtype=np.float32)))


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.service = create_service({k: v["string_value"] for k, v in parameters.items()}, pb_utils,
                                      args["model_name"], args["model_version"],
                                      instance_kind=args.get("model_instance_kind"),
                                      instance_device_id=args.get("model_instance_device_id"))
        self.service.start()
        self.hidden_size = self.service.engine.runner.model.embed_tokens.weight.shape[1]

    def execute(self, requests):
        for request in requests:
            sink = _Sink(request.get_response_sender())
            try:
                arrays = request_arrays(pb_utils, request, INPUT_NAMES)
                if is_reset_request(arrays):  # waits for the engine loop (at most one step)
                    given_key = json.loads(request.parameters() or "{}").get(ADMIN_KEY_HEADER)
                    sink.send_dropped_blocks(self.service.reset_prefix_cache_as_operator(given_key))
                    continue
                key = cancel_key(arrays)
                if key is not None:
                    self.service.cancel(key)
                    sink.close()
                    continue
                ids, params = generation_inputs(arrays)
                request_id = (one_value(arrays, "stream_key", str)
                              or f"{request.request_id() or 'req'}-{uuid.uuid4().hex[:12]}")
                embeds = _prompt_embeds(request, self.hidden_size)
                self.service.submit(request_id, ids, params, sink, prompt_embeds=embeds)
            except Exception as exc:  # bad input, refused (too hot, queue full), or a fault: this request only
                sink.fail(StageError.of(exc, "llm"))
        return None

    def finalize(self):
        self.service.shutdown()
