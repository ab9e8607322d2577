"""Triton glue for the postprocess stage; the logic is omni_backend/stages/postprocess.py."""

from omni_backend.stages.postprocess import Postprocessor
from omni_backend.stages.triton_glue import StageModel


class TritonPythonModel(StageModel):
    NAME = "postprocess"

    def build(self, parameters):
        return Postprocessor.from_parameters(parameters)
