"""Triton glue for the decoupled tts stage; the logic is omni_backend/stages/tts.py.

`execute` validates and plans each request (chunk boundaries, stream state) and returns at once; the
SpeechWorker thread synthesizes the chunks, lowest chunk index first across requests, and sends them.
"""

import json

import triton_python_backend_utils as pb_utils

from omni_backend.ops.metrics import StageHeartbeat
from omni_backend.stages.tensors import request_arrays, triton_error
from omni_backend.stages.tts import ENGINES, INPUT_NAMES, SpeechStage, SpeechWorker


class _Sink:
    """One request's response sender."""

    def __init__(self, sender):
        self.sender = sender

    def send(self, outputs, final):
        response = pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()])
        self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def fail(self, error):
        self.sender.send(pb_utils.InferenceResponse(error=triton_error(pb_utils, error, "tts")),
                         flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self):
        return self.sender.is_cancelled()


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
        self.worker = SpeechWorker(self.stage)
        self.heartbeat = StageHeartbeat(pb_utils, args["model_name"], args["model_version"])

    def execute(self, requests):
        for request in requests:
            sink = _Sink(request.get_response_sender())
            arrays = request_arrays(pb_utils, request, INPUT_NAMES)
            try:
                options, chunks = self.stage.plan(arrays)
            except Exception as exc:  # bad input, or a fault: answer this request with an error, keep the stub
                sink.fail(exc)
                continue
            if chunks:
                self.worker.submit(options, chunks, sink)
            else:  # a stream delta that completed no phrase: nothing to say yet
                sink.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self):
        self.heartbeat.stop()
        self.worker.shutdown()
