"""Triton glue for the diffusion stage (dynamic batching); the logic is omni_backend/stages/diffusion.py."""

from omni_backend.stages.diffusion import DiffusionStage
from omni_backend.stages.triton_glue import StageModel


class TritonPythonModel(StageModel):
    NAME = "diffusion"
    BATCHED = True

    def build(self, parameters):
        return DiffusionStage.from_parameters(parameters)
