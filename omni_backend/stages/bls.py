"""Triton's side of the streaming entry points (omni_backend/stages/entry_points.py): stage calls as BLS requests,
the entry point's response sender, and the glue its three model.py files share.

`pb_utils` is the stub's `triton_python_backend_utils` module, passed in because it exists only inside a Triton
stub process.

Two objects outlive their use here by `triton_glue.RETIRE_AFTER_S` (`triton_glue.Retired`), because python_backend
24.10 (like its main branch) still touches them from another thread for a moment:
- a finished response iterator of `exec(decoupled=True)`: the stub's iterator map holds it until a C++ thread
  without the GIL erases it, a little after the last response; if that erase drops the last reference, the
  iterator's responses release their numpy arrays without the GIL and concurrent Python threads corrupt the
  interpreter's heap (seen here: the entry point's stub dying in pymalloc under a storm of cancelled streams);
- a response sender after its final flag (see `triton_glue.Retired`).
"""

from __future__ import annotations

import json
from typing import Generator

import numpy as np

from omni_backend.stages.entry_points import EntryPoint, StageFailure, Steps
from omni_backend.stages.triton_glue import (Retired, StreamSender, release_python_objects, request_arrays,
                                             start_heartbeat, string_parameters)
from omni_backend.vocabulary import StageError


class BlsStages:
    """The `Stages` of an entry point: each call one BLS request, carrying the entry point's request id."""

    def __init__(self, pb_utils, retired: Retired):
        self.pb_utils, self.retired = pb_utils, retired

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
               request_id: str) -> Generator[dict[str, np.ndarray], None, None]:
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
            self.retired.add(responses)


class SenderClient(StreamSender):
    """The entry point's `Client`: its response sender (`StreamSender`, retired after its final flag), passing a
    stage's failure on with that stage's own message and code."""

    def fail(self, error: StageFailure | StageError) -> None:
        if isinstance(error, StageFailure):
            self._final(self.pb_utils.InferenceResponse(error=self.pb_utils.TritonError(error.message, error.code)))
        else:
            super().fail(error)


class EntryPointModel:
    """What an entry point's `TritonPythonModel` does: `initialize(args)`, `execute(requests)`, `finalize()`.

    Args:
        pb_utils: the stub's `triton_python_backend_utils`.
    """

    def __init__(self, pb_utils):
        self.pb_utils = pb_utils

    def initialize(self, args: dict) -> None:
        self.name = args["model_name"]
        self.inputs = [spec["name"] for spec in json.loads(args["model_config"]).get("input", [])]
        self.retired = Retired()
        self.entry = EntryPoint(self.name, Steps.from_parameters(string_parameters(args)),
                                BlsStages(self.pb_utils, self.retired))
        self.heartbeat = start_heartbeat(self.pb_utils, args)

    def execute(self, requests: list) -> None:
        for request in requests:
            client = SenderClient(self.pb_utils, request.get_response_sender(), self.name, self.retired)
            try:
                # copies: the request's tensors may be released once execute returns, before its thread reads them
                arrays = {name: np.array(array) for name, array in request_arrays(self.pb_utils, request,
                                                                                   self.inputs).items()}
            except Exception as exc:  # unreadable inputs: this request only
                client.fail(StageError.of(exc, self.name))
                continue
            self.entry.submit(arrays, client, request.request_id())

    def finalize(self) -> None:
        try:
            self.heartbeat.stop()
            self.entry.shutdown()
        finally:
            release_python_objects(self)
