"""Triton glue for the decoupled tts stage; the logic is omni_backend/stages/tts.py."""

import json

import triton_python_backend_utils as pb_utils

from omni_backend.stages.tts import ENGINES, INPUT_NAMES, SpeechStage


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        setting = {key: value["string_value"] for key, value in parameters.items()}
        engine = setting.get("engine", "piper")
        if engine not in ENGINES:
            raise ValueError(f"tts engine '{engine}' is unknown; known: {', '.join(ENGINES)}")
        synthesizer = ENGINES[engine](threads=int(setting.get("threads", "0")))
        self.stage = SpeechStage(synthesizer, max_text_chars=int(setting.get("max_text_chars", "4096")),
                                 stream_ttl_s=float(setting.get("stream_ttl_s", "600")))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            arrays = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    arrays[name] = tensor.as_numpy()
            try:
                for outputs in self.stage.run(arrays):
                    if sender.is_cancelled():
                        break
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except ValueError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:  # never take the stub down: answer this request with an error
                error = pb_utils.TritonError(f"tts failed: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)
                sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
