"""Triton glue for speech_options: validate voice/format/speed, pack them with a fresh stream id
(omni_backend/stages/tts_options.py)."""

import triton_python_backend_utils as pb_utils

from omni_backend.stages.triton_glue import respond_each, start_heartbeat
from omni_backend.stages.tts_options import SPEECH_OPTION_INPUTS, speech_options_outputs


class TritonPythonModel:
    def initialize(self, args):
        self.heartbeat = start_heartbeat(pb_utils, args)

    def execute(self, requests):
        return respond_each(pb_utils, requests, SPEECH_OPTION_INPUTS, speech_options_outputs, "speech_options")

    def finalize(self):
        self.heartbeat.stop()
