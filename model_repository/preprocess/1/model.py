"""Triton glue for the preprocess stage; the logic is omni_backend/stages/preprocess.py."""

import triton_python_backend_utils as pb_utils

from omni_backend.stages.preprocess import INPUT_NAMES, Preprocessor
from omni_backend.stages.triton_glue import respond_each, start_heartbeat, string_parameters


class TritonPythonModel:
    def initialize(self, args):
        self.stage = Preprocessor.from_parameters(string_parameters(args))
        self.heartbeat = start_heartbeat(pb_utils, args)

    def execute(self, requests):
        return respond_each(pb_utils, requests, INPUT_NAMES, self.stage.run, "preprocess")

    def finalize(self):
        self.heartbeat.stop()
