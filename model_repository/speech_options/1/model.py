"""Triton glue for speech_options: validate voice/format/speed, pack them with a fresh stream id
(omni_backend/stages/tts_options.py)."""

from omni_backend.stages.triton_glue import StageModel
from omni_backend.stages.tts_options import SPEECH_OPTION_INPUTS, speech_options_outputs


class TritonPythonModel(StageModel):
    NAME = "speech_options"

    def input_names(self):
        return SPEECH_OPTION_INPUTS

    def run(self, arrays):
        return speech_options_outputs(arrays)
