"""Triton glue for the postprocess stage; the logic is omni_backend/stages/postprocess.py."""

import json

import triton_python_backend_utils as pb_utils

from omni_backend.ops.metrics import StageHeartbeat
from omni_backend.stages.tensors import respond_each
from omni_backend.stages.postprocess import INPUT_NAMES, Postprocessor


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        setting = {key: value["string_value"] for key, value in parameters.items()}
        self.stage = Postprocessor.from_pretrained(setting["llm_model_path"])
        self.heartbeat = StageHeartbeat(pb_utils, args["model_name"], args["model_version"])

    def execute(self, requests):
        return respond_each(pb_utils, requests, INPUT_NAMES, self.stage.run, "postprocess")

    def finalize(self):
        self.heartbeat.stop()
