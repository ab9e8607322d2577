"""Triton glue for the media_embed BLS step: encoder calls per media item, spliced into llm prompt embeddings
(omni_backend/stages/media_encoder.py)."""

import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from omni_backend import tensor_names as T
from omni_backend.stages.media_encoder import encoder_calls, splice_embeddings
from omni_backend.stages.triton_glue import (
    release_python_objects,
    request_arrays,
    response,
    start_heartbeat,
    triton_error,
)
from omni_backend.stages.tensors import one_value
from omni_backend.vocabulary import ErrorKind, StageError

INPUT_NAMES = (T.MEDIA_PARTS, T.MEDIA_POSITIONS, T.PIXEL_VALUES, T.INPUT_FEATURES)


class TritonPythonModel:
    def initialize(self, args):
        self.heartbeat = start_heartbeat(pb_utils, args)

    async def execute(self, requests):
        return list(await asyncio.gather(*(self._one(request) for request in requests)))

    async def _one(self, request):
        try:
            arrays = request_arrays(pb_utils, request, INPUT_NAMES)
            parts = json.loads(one_value(arrays, T.MEDIA_PARTS, str))
            if not parts:
                return response(pb_utils, {T.PROMPT_EMBEDS: np.zeros((0, 0), dtype=np.float32),
                                           T.PROMPT_EMBED_POSITIONS: np.zeros(0, dtype=np.int32)})
            calls = encoder_calls(parts, arrays.get(T.PIXEL_VALUES), arrays.get(T.INPUT_FEATURES))
            encoder_requests = [
                pb_utils.InferenceRequest(model_name=call.model, requested_output_names=[T.EMBEDDINGS],
                                          inputs=[pb_utils.Tensor(k, v) for k, v in call.inputs.items()])
                for call in calls]
            outputs = []
            for answer in await asyncio.gather(*(r.async_exec() for r in encoder_requests)):
                if answer.has_error():  # the encoder's own error kind goes on (a fault stays the server's)
                    message = answer.error().message()
                    raise StageError.parse(message) or StageError(ErrorKind.INTERNAL, message)
                outputs.append(pb_utils.get_output_tensor_by_name(answer, T.EMBEDDINGS).as_numpy())
            return response(pb_utils, splice_embeddings(parts, arrays[T.MEDIA_POSITIONS], calls, outputs))
        except (KeyError, IndexError, json.JSONDecodeError) as exc:  # media_parts that do not describe the items
            return pb_utils.InferenceResponse(error=triton_error(pb_utils, ValueError(f"media_embed: {exc}"),
                                                                 "media_embed"))
        except Exception as exc:  # this request only
            return pb_utils.InferenceResponse(error=triton_error(pb_utils, exc, "media_embed"))

    def finalize(self):
        try:
            self.heartbeat.stop()
        finally:
            release_python_objects(self)
