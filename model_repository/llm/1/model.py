"""Triton glue for the decoupled llm stage; the engine, its threads and the tensors' meaning live in
omni_backend/stages/llm/."""

import json
import uuid

import triton_python_backend_utils as pb_utils

from omni_backend.stages.llm.build import create_service
from omni_backend.stages.llm.dynamo_endpoint import serve_stage_on_dynamo
from omni_backend.stages.llm.triton_io import INPUT_NAMES, serve_request
from omni_backend.stages.triton_glue import (
    Retired,
    StreamSender,
    release_python_objects,
    request_arrays,
    string_parameters,
)


class TritonPythonModel:
    def initialize(self, args):
        parameters = string_parameters(args)
        self.service = create_service(parameters, pb_utils, args["model_name"], args["model_version"],
                                      instance_kind=args.get("model_instance_kind"),
                                      instance_device_id=args.get("model_instance_device_id"))
        self.service.start()
        self.dynamo = serve_stage_on_dynamo(self.service, parameters)  # None unless dynamo_endpoint is set
        self.retired = Retired()  # response senders, freed a few seconds after their final flag

    def execute(self, requests):
        for request in requests:
            sender = StreamSender(pb_utils, request.get_response_sender(), "llm", self.retired)
            try:
                arrays = request_arrays(pb_utils, request, INPUT_NAMES)
                parameters = json.loads(request.parameters() or "{}")
            except Exception as exc:  # unreadable inputs: this request only
                sender.fail(exc)
                continue
            request_id = f"{request.request_id() or 'req'}-{uuid.uuid4().hex[:12]}"
            serve_request(self.service, arrays, parameters, request_id, sender)
        return None

    def finalize(self):
        try:
            if self.dynamo is not None:  # Dynamo drains its requests before the engine's threads stop
                self.dynamo.stop()
            self.service.shutdown()
        finally:
            release_python_objects(self)
