"""Triton glue for png_encode: each image of each request -> PNG bytes."""

import numpy as np
import triton_python_backend_utils as pb_utils

from omni_backend.ops.metrics import StageHeartbeat
from omni_backend.stages.diffusion import encode_png
from omni_backend.stages.tensors import triton_error


class TritonPythonModel:
    def initialize(self, args):
        self.heartbeat = StageHeartbeat(pb_utils, args["model_name"], args["model_version"])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                images = pb_utils.get_input_tensor_by_name(request, "image").as_numpy()
                pngs = np.array([[encode_png(image)] for image in images], dtype=np.object_)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("png", pngs)]))
            except Exception as exc:  # bad shape or encoder failure: this request only
                responses.append(pb_utils.InferenceResponse(error=triton_error(pb_utils, exc, "png_encode")))
        return responses

    def finalize(self):
        self.heartbeat.stop()
