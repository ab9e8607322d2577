"""Triton glue for the preprocess stage; the logic is omni_backend/stages/preprocess.py."""

import json

import triton_python_backend_utils as pb_utils

from omni_backend.ops.metrics import StageHeartbeat
from omni_backend.stages.tensors import respond_each
from omni_backend.stages.preprocess import INPUT_NAMES, MediaConfig, Preprocessor


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        setting = {key: value["string_value"] for key, value in parameters.items()}
        self.stage = Preprocessor.from_pretrained(setting["llm_model_path"], int(setting["max_model_len"]),
                                                  MediaConfig.from_parameters(setting),
                                                  setting["completions_allow_special_tokens"] == "true")
        self.heartbeat = StageHeartbeat(pb_utils, args["model_name"], args["model_version"])

    def execute(self, requests):
        return respond_each(pb_utils, requests, INPUT_NAMES, self.stage.run, "preprocess")

    def finalize(self):
        self.heartbeat.stop()
