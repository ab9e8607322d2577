"""Triton's side of the streaming entry points (omni_backend/stages/entry_points.py): stage calls as BLS requests,
the entry point's response sender, and the glue its three model.py files share.

`pb_utils` is the stub's `triton_python_backend_utils` module, passed in because it exists only inside a Triton
stub process.

Two objects outlive their use here by RETIRE_AFTER_S (`Retired`), because python_backend 24.10 (like its main
branch) still touches them from another thread for a moment:
- a finished response iterator of `exec(decoupled=True)`: the stub's iterator map holds it until a C++ thread
  without the GIL erases it, a little after the last response; if that erase drops the last reference, the
  iterator's responses release their numpy arrays without the GIL and concurrent Python threads corrupt the
  interpreter's heap (seen here: the entry point's stub dying in pymalloc under a storm of cancelled streams);
- a response sender after its final flag: the server's thread that answered its last `is_cancelled()` still
  unlocks a mutex in shared memory that the sender frees with itself.
Released later by `Retired`'s own thread, they are freed with the GIL and after those threads are done.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import Generator

import numpy as np

from omni_backend.stages.entry_points import EntryPoint, StageFailure, Steps
from omni_backend.stages.triton_glue import request_arrays, response, start_heartbeat, string_parameters, triton_error
from omni_backend.vocabulary import StageError


RETIRE_AFTER_S = 5.0  # those other threads let go within milliseconds


class Retired:
    """Objects done with, each released RETIRE_AFTER_S after `add`, from this object's thread."""

    def __init__(self):
        self._items: collections.deque = collections.deque()  # (time.monotonic() at add, object)
        threading.Thread(target=self._loop, name="bls-retired", daemon=True).start()

    def add(self, item) -> None:
        self._items.append((time.monotonic(), item))

    def _loop(self) -> None:
        while True:
            time.sleep(1.0)
            cutoff = time.monotonic() - RETIRE_AFTER_S
            while self._items and self._items[0][0] < cutoff:
                self._items.popleft()


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


class SenderClient:
    """The entry point's `Client`: its Triton response sender, retired once its final flag went."""

    def __init__(self, pb_utils, sender, model: str, retired: Retired):
        self.pb_utils, self.sender, self.model, self.retired = pb_utils, sender, model, retired

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None:
        if final:
            self._final(response(self.pb_utils, outputs))
        else:
            self.sender.send(response(self.pb_utils, outputs), flags=0)

    def fail(self, error: StageFailure | StageError) -> None:
        pb = self.pb_utils
        triton = (pb.TritonError(error.message, error.code) if isinstance(error, StageFailure)
                  else triton_error(pb, error, self.model))
        self._final(pb.InferenceResponse(error=triton))

    def close(self) -> None:
        self._final(None)

    def _final(self, response) -> None:
        try:
            if response is None:
                self.sender.send(flags=self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                self.sender.send(response, flags=self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            self.retired.add(self.sender)

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
        self.heartbeat.stop()
        self.entry.shutdown()
