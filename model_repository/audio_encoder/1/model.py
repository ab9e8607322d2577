"""Triton glue for the audio_encoder stage (dynamic batching); the encoder lives in omni_backend/stages."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from omni_backend.ops.metrics import EncoderMetrics, StageHeartbeat
from omni_backend.stages.media_encoder import create_stage
from omni_backend.stages.tensors import triton_error


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.stage = create_stage("audio", {k: v["string_value"] for k, v in parameters.items()})
        self.heartbeat = StageHeartbeat(pb_utils, args["model_name"], args["model_version"])
        self.metrics = EncoderMetrics(pb_utils, args["model_name"], args["model_version"])

    def execute(self, requests):
        arrays = [pb_utils.get_input_tensor_by_name(r, "input_features").as_numpy() for r in requests]
        lengths = [pb_utils.get_input_tensor_by_name(r, "input_lengths").as_numpy().reshape(-1) for r in requests]
        try:
            outputs = self.stage.run(arrays, lengths)
        except ValueError as exc:
            error = triton_error(pb_utils, exc, "audio_encoder")
            return [pb_utils.InferenceResponse(error=error) for _ in requests]
        self.metrics.publish(self.stage.num_items, self.stage.num_encoded)
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("embeddings", np.ascontiguousarray(o))])
                for o in outputs]

    def finalize(self):
        self.heartbeat.stop()
