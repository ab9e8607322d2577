"""Triton glue for the diffusion stage (dynamic batching); the logic is omni_backend/stages/diffusion.py."""

import triton_python_backend_utils as pb_utils

from omni_backend.stages.diffusion import INPUT_NAMES, DiffusionStage
from omni_backend.stages.triton_glue import respond_batch, start_heartbeat, string_parameters


class TritonPythonModel:
    def initialize(self, args):
        self.stage = DiffusionStage.from_parameters(string_parameters(args))
        self.heartbeat = start_heartbeat(pb_utils, args)

    def execute(self, requests):
        return respond_batch(pb_utils, requests, INPUT_NAMES, self.stage.run_batch, "diffusion")

    def finalize(self):
        self.heartbeat.stop()
