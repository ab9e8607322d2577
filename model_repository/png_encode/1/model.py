"""Triton glue for png_encode: each image of each request -> PNG bytes (omni_backend/stages/diffusion.py)."""

from omni_backend import tensor_names as T
from omni_backend.stages.diffusion import png_outputs
from omni_backend.stages.triton_glue import StageModel


class TritonPythonModel(StageModel):
    NAME = "png_encode"

    def input_names(self):
        return (T.IMAGE,)

    def run(self, arrays):
        return png_outputs(arrays)
