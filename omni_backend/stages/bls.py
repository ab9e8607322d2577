"""Triton's side of the streaming entry points (omni_backend/stages/entry_points.py): stage calls as BLS requests,
the entry point's response sender, and the glue its three model.py files share.

`pb_utils` is the stub's `triton_python_backend_utils` module, passed in because it exists only inside a Triton
stub process.
"""

from __future__ import annotations

import json
from typing import Iterator

import numpy as np

from omni_backend.ops.metrics import StageHeartbeat
from omni_backend.stages.entry_points import EntryPoint, StageFailure, Steps
from omni_backend.stages.tensors import request_arrays, triton_error
from omni_backend.vocabulary import StageError


class BlsStages:
    """The `Stages` of an entry point: each call one BLS request, carrying the entry point's request id."""

    def __init__(self, pb_utils):
        self.pb_utils = pb_utils

    def _request(self, model: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...], request_id: str):
        pb = self.pb_utils
        return pb.InferenceRequest(model_name=model, inputs=[pb.Tensor(k, v) for k, v in inputs.items()],
                                   requested_output_names=list(outputs), request_id=request_id)

    def infer(self, model: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...],
              request_id: str) -> dict[str, np.ndarray]:
        response = self._request(model, inputs, outputs, request_id).exec()
        if response.has_error():
            raise StageFailure(response.error().message(), response.error().code())
        return {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}

    def stream(self, model: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...],
               request_id: str) -> Iterator[dict[str, np.ndarray]]:
        """A generator; closing it early waits for the model's final flag (the caller has asked the model to end
        the stream, or it ends on its own)."""
        responses = self._request(model, inputs, outputs, request_id).exec(decoupled=True)
        try:
            for response in responses:
                if response.has_error():
                    raise StageFailure(response.error().message(), response.error().code())
                tensors = response.output_tensors()
                if tensors:  # a final flag sent alone arrives as a response without outputs
                    yield {tensor.name(): tensor.as_numpy() for tensor in tensors}
        finally:
            for _ in responses:
                pass


class SenderClient:
    """The entry point's `Client`: its Triton response sender."""

    def __init__(self, pb_utils, sender, model: str):
        self.pb_utils, self.sender, self.model = pb_utils, sender, model

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None:
        pb = self.pb_utils
        self.sender.send(pb.InferenceResponse([pb.Tensor(k, v) for k, v in outputs.items()]),
                         flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def fail(self, error: StageFailure | StageError) -> None:
        pb = self.pb_utils
        triton = (pb.TritonError(error.message, error.code) if isinstance(error, StageFailure)
                  else triton_error(pb, error, self.model))
        self.sender.send(pb.InferenceResponse(error=triton), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def close(self) -> None:
        self.sender.send(flags=self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


class EntryPointModel:
    """What an entry point's `TritonPythonModel` does: `initialize(args)`, `execute(requests)`, `finalize()`.

    Args:
        pb_utils: the stub's `triton_python_backend_utils`.
    """

    def __init__(self, pb_utils):
        self.pb_utils = pb_utils

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        self.inputs = [spec["name"] for spec in config.get("input", [])]
        parameters = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.entry = EntryPoint(self.name, Steps.from_parameters(parameters), BlsStages(self.pb_utils))
        self.heartbeat = StageHeartbeat(self.pb_utils, self.name, args["model_version"])

    def execute(self, requests: list) -> None:
        for request in requests:
            client = SenderClient(self.pb_utils, request.get_response_sender(), self.name)
            # copies: the request's tensors may be released once execute returns, before its thread reads them
            arrays = {name: np.array(array) for name, array in request_arrays(self.pb_utils, request,
                                                                               self.inputs).items()}
            self.entry.submit(arrays, client, request.request_id())

    def finalize(self) -> None:
        self.heartbeat.stop()
        self.entry.shutdown()
