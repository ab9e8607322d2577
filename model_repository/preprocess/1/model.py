"""Triton glue for the preprocess stage; the logic is omni_backend/stages/preprocess.py."""

import json

import triton_python_backend_utils as pb_utils

from omni_backend.stages.preprocess import INPUT_NAMES, MediaConfig, Preprocessor


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        setting = {key: value["string_value"] for key, value in parameters.items()}
        self.stage = Preprocessor.from_pretrained(setting["llm_model_path"], int(setting["max_model_len"]),
                                                  MediaConfig.from_parameters(setting))

    def execute(self, requests):
        responses = []
        for request in requests:
            arrays = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    arrays[name] = tensor.as_numpy()
            try:
                outputs = self.stage.run(arrays)
            except ValueError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            except Exception as exc:  # never take the stub down: answer this request with an error
                message = f"preprocess failed: {type(exc).__name__}: {exc}"
                error = pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()]))
        return responses
