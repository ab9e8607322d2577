"""Triton glue for the diffusion stage (dynamic batching); the logic is omni_backend/stages/diffusion.py."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from omni_backend.ops.metrics import StageHeartbeat
from omni_backend.stages.tensors import request_arrays, triton_error
from omni_backend.stages.diffusion import INPUT_NAMES, DiffusionStage, ImageLimits, ImageRequest


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        setting = {key: value["string_value"] for key, value in parameters.items()}
        self.stage = DiffusionStage.from_pretrained(setting["model_path"], ImageLimits.from_parameters(setting),
                                                    setting.get("device", "auto"), setting.get("dtype", "auto"),
                                                    float(setting.get("gpu_memory_fraction") or 1.0))
        self.heartbeat = StageHeartbeat(pb_utils, args["model_name"], args["model_version"])

    def execute(self, requests):
        responses = [None] * len(requests)
        valid, indices = [], []
        for index, request in enumerate(requests):
            arrays = request_arrays(pb_utils, request, INPUT_NAMES)
            try:
                valid.append(ImageRequest.from_arrays(arrays, self.stage.limits))
                indices.append(index)
            except ValueError as exc:
                responses[index] = pb_utils.InferenceResponse(error=triton_error(pb_utils, exc, "diffusion"))
        if valid:
            try:
                images = self.stage.generate(valid)
                for index, item, image in zip(indices, valid, images):
                    responses[index] = pb_utils.InferenceResponse([
                        pb_utils.Tensor("image", image[np.newaxis]),
                        pb_utils.Tensor("seed", np.array([[item.seed]], dtype=np.int64)),
                    ])
            except Exception as exc:  # never take the stub down: answer these requests with an error
                error = triton_error(pb_utils, exc, "diffusion")
                for index in indices:
                    responses[index] = pb_utils.InferenceResponse(error=error)
        return responses

    def finalize(self):
        self.heartbeat.stop()
