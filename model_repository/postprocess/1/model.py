"""Triton glue for the postprocess stage; the logic is omni_backend/stages/postprocess.py."""

import triton_python_backend_utils as pb_utils

from omni_backend.stages.postprocess import INPUT_NAMES, Postprocessor
from omni_backend.stages.triton_glue import respond_each, start_heartbeat, string_parameters


class TritonPythonModel:
    def initialize(self, args):
        self.stage = Postprocessor.from_parameters(string_parameters(args))
        self.heartbeat = start_heartbeat(pb_utils, args)

    def execute(self, requests):
        return respond_each(pb_utils, requests, INPUT_NAMES, self.stage.run, "postprocess")

    def finalize(self):
        self.heartbeat.stop()
