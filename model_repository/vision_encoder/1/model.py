"""Triton glue for the vision_encoder stage (dynamic batching); the encoder: omni_backend/stages/media_encoder.py."""

import triton_python_backend_utils as pb_utils

from omni_backend.ops.metrics import EncoderMetrics
from omni_backend.stages.media_encoder import create_stage
from omni_backend.stages.triton_glue import respond_batch, start_heartbeat, string_parameters


class TritonPythonModel:
    def initialize(self, args):
        self.stage = create_stage("image", string_parameters(args))
        self.heartbeat = start_heartbeat(pb_utils, args)
        self.metrics = EncoderMetrics(pb_utils, args["model_name"], args["model_version"])

    def execute(self, requests):
        responses = respond_batch(pb_utils, requests, self.stage.input_names, self.stage.run_batch,
                                  "vision_encoder")
        self.metrics.publish(self.stage.num_items, self.stage.num_encoded)
        return responses

    def finalize(self):
        self.heartbeat.stop()
