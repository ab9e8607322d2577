"""Triton glue for the preprocess stage; the logic is omni_backend/stages/preprocess.py."""

from omni_backend.stages.preprocess import Preprocessor
from omni_backend.stages.triton_glue import StageModel


class TritonPythonModel(StageModel):
    NAME = "preprocess"

    def build(self, parameters):
        return Preprocessor.from_parameters(parameters)
