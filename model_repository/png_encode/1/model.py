"""Triton glue for png_encode: each image of each request -> PNG bytes (omni_backend/stages/diffusion.py)."""

import triton_python_backend_utils as pb_utils

from omni_backend import tensor_names as T
from omni_backend.stages.diffusion import png_outputs
from omni_backend.stages.triton_glue import respond_each, start_heartbeat


class TritonPythonModel:
    def initialize(self, args):
        self.heartbeat = start_heartbeat(pb_utils, args)

    def execute(self, requests):
        return respond_each(pb_utils, requests, (T.IMAGE,), png_outputs, "png_encode")

    def finalize(self):
        self.heartbeat.stop()
