"""Triton glue for the decoupled tts stage; the logic is omni_backend/stages/tts.py.

`execute` validates and plans each request (chunk boundaries, stream state) and returns at once; the
SpeechWorker thread synthesizes the chunks, lowest chunk index first across requests, and sends them.
"""

import triton_python_backend_utils as pb_utils

from omni_backend.stages.triton_glue import (
    Retired,
    StreamSender,
    release_python_objects,
    request_arrays,
    start_heartbeat,
    string_parameters,
)
from omni_backend.stages.tts import INPUT_NAMES, SpeechStage, SpeechWorker, serve_request


class TritonPythonModel:
    def initialize(self, args):
        self.stage = SpeechStage.from_parameters(string_parameters(args))
        self.worker = SpeechWorker(self.stage)
        self.retired = Retired()  # response senders, freed a few seconds after their final flag
        self.heartbeat = start_heartbeat(pb_utils, args)

    def execute(self, requests):
        for request in requests:
            sender = StreamSender(pb_utils, request.get_response_sender(), "tts", self.retired)
            try:
                arrays = request_arrays(pb_utils, request, INPUT_NAMES)
            except Exception as exc:  # unreadable inputs: this request only
                sender.fail(exc)
                continue
            serve_request(self.stage, self.worker, arrays, sender)
        return None

    def finalize(self):
        try:
            self.heartbeat.stop()
            self.worker.shutdown()
        finally:
            release_python_objects(self)
