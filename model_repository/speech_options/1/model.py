"""Triton glue for speech_options: validate voice/format/speed, pack them with a fresh stream id."""

import triton_python_backend_utils as pb_utils

from omni_backend.ops.metrics import StageHeartbeat
from omni_backend.stages.tensors import one_value, string_tensor, triton_error
from omni_backend.stages.tts_options import SpeechOptions


class TritonPythonModel:
    def initialize(self, args):
        self.heartbeat = StageHeartbeat(pb_utils, args["model_name"], args["model_version"])

    def execute(self, requests):
        responses = []
        for request in requests:
            arrays = {}
            for name in ("voice", "audio_format", "speed"):
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    arrays[name] = tensor.as_numpy()
            try:
                options = SpeechOptions.create(one_value(arrays, "voice", str), one_value(arrays, "audio_format", str),
                                               one_value(arrays, "speed", float), stream=True)
            except ValueError as exc:
                responses.append(pb_utils.InferenceResponse(error=triton_error(pb_utils, exc, "speech_options")))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("options",
                                                                         string_tensor(options.to_json()))]))
        return responses

    def finalize(self):
        self.heartbeat.stop()
