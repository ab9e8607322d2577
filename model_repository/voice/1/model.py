"""Triton glue for the decoupled voice stage; the logic is omni_backend/stages/voice.py.

`execute` parses each request and queues it for the VoiceWorker thread, which drives the talker engine and code2wav
and sends the chunks.
"""

import triton_python_backend_utils as pb_utils

from omni_backend.ops.metrics import VoiceMetrics
from omni_backend.stages.triton_glue import (
    Retired,
    StreamSender,
    release_python_objects,
    request_arrays,
    start_heartbeat,
    string_parameters,
)
from omni_backend.stages.voice import INPUT_NAMES, build_worker
from omni_backend.vocabulary import ErrorKind, StageError


class TritonPythonModel:
    def initialize(self, args):
        self.metrics = VoiceMetrics(pb_utils, args["model_name"], args["model_version"])
        self.worker = build_worker(string_parameters(args), self.metrics.publish)
        self.retired = Retired()  # response senders, freed a few seconds after their final flag
        self.heartbeat = start_heartbeat(pb_utils, args)

    def execute(self, requests):
        for request in requests:
            sender = StreamSender(pb_utils, request.get_response_sender(), "voice", self.retired)
            if self.worker is None:
                sender.fail(StageError(ErrorKind.UNAVAILABLE, "the served model has no talker (no voice of its own)"))
                continue
            try:
                arrays = request_arrays(pb_utils, request, INPUT_NAMES)
            except Exception as exc:  # unreadable inputs: this request only
                sender.fail(exc)
                continue
            self.worker.submit(arrays, sender)
        return None

    def finalize(self):
        try:
            self.heartbeat.stop()
            if self.worker is not None:
                self.worker.shutdown()
        finally:
            release_python_objects(self)
