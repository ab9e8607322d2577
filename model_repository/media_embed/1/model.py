"""Triton glue for the media_embed BLS step: encoder calls per media item, spliced into llm prompt embeddings."""

import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from omni_backend.ops.metrics import StageHeartbeat
from omni_backend.stages.media_encoder import ENCODERS, encoder_calls, splice_embeddings
from omni_backend.stages.tensors import triton_error


class TritonPythonModel:
    def initialize(self, args):
        self.heartbeat = StageHeartbeat(pb_utils, args["model_name"], args["model_version"])

    async def execute(self, requests):
        return list(await asyncio.gather(*(self._one(request) for request in requests)))

    async def _one(self, request):
        try:
            text = pb_utils.get_input_tensor_by_name(request, "media_parts").as_numpy().reshape(-1)[0]
            parts = json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
            positions = pb_utils.get_input_tensor_by_name(request, "media_positions").as_numpy()
            if not parts:
                return self._response(np.zeros((0, 0), dtype=np.float32), np.zeros(0, dtype=np.int32))
            calls = encoder_calls(parts, *(pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                                           for _, name in ENCODERS.values()))
            requests = [pb_utils.InferenceRequest(model_name=call.model, requested_output_names=["embeddings"],
                                                  inputs=[pb_utils.Tensor(k, v) for k, v in call.inputs.items()])
                        for call in calls]
            outputs = []
            for response in await asyncio.gather(*(r.async_exec() for r in requests)):
                if response.has_error():
                    raise ValueError(response.error().message())
                outputs.append(pb_utils.get_output_tensor_by_name(response, "embeddings").as_numpy())
            spliced = splice_embeddings(parts, positions, calls, outputs)
            return self._response(spliced["prompt_embeds"], spliced["prompt_embed_positions"])
        except (ValueError, KeyError, IndexError) as exc:
            return pb_utils.InferenceResponse(error=triton_error(pb_utils, ValueError(f"media_embed: {exc}"),
                                                                 "media_embed"))

    @staticmethod
    def _response(embeds, positions):
        return pb_utils.InferenceResponse([pb_utils.Tensor("prompt_embeds", embeds),
                                           pb_utils.Tensor("prompt_embed_positions", positions)])

    def finalize(self):
        self.heartbeat.stop()
