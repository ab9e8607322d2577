"""The one shape of every `model_repository/<stage>/1/model.py`: what touches `triton_python_backend_utils`.

A model's glue parses its string parameters in `initialize` (`string_parameters`), starts its heartbeat
(`start_heartbeat`), and in `execute` answers every request on its own, so one bad request never fails another
(`StageModel` is all of that for a stage that answers at once):

- `respond_each`: one response per request, `run(arrays)` -> output arrays;
- `respond_batch`: a dynamic batch run together, `run_batch([arrays, ...])` -> one result per item, either its output
  arrays or the exception that item alone ends with;
- `StreamSender`: a decoupled request's response sender (responses, its error, its final flag, cancellation);
- `release_python_objects`: the last call of every `finalize`.

Errors leave a stage as `pb_utils.TritonError`s whose message carries the error kind's header
(`omni_backend.vocabulary.StageError`). `pb_utils` is passed in because it only exists inside a stub process.
"""

from __future__ import annotations

import collections
import gc
import json
import threading
import time
from typing import Callable

import numpy as np

from omni_backend.ops.metrics import StageHeartbeat
from omni_backend.settings import config_parameters
from omni_backend.vocabulary import StageError


def string_parameters(args: dict) -> dict[str, str]:
    """A model's `parameters` (its `config.pbtxt`, as Triton hands it in `args["model_config"]`) as name -> string."""
    return config_parameters(json.loads(args["model_config"]))


def start_heartbeat(pb_utils, args: dict) -> StageHeartbeat:
    """The stage's heartbeat gauge, beating from now on (ops/metrics.py); stop it in `finalize`."""
    return StageHeartbeat(pb_utils, args["model_name"], args["model_version"])


def release_python_objects(model) -> None:
    """Drop every attribute of `model` (a `TritonPythonModel`) and collect garbage, at the end of its `finalize`:
    Triton metric families (`pb_utils.MetricFamily`) left for the interpreter's shutdown are destroyed after the
    stub's own state and segfault it in `Metric::Clear` (triton-inference-server/python_backend#429, fixed after
    Triton 2.51); destroyed here, while the stub is whole, they unregister cleanly. So are the response senders a
    `Retired` of the model still holds (`Retired.release`): freed at exit, they segfaulted the stub in the
    deleter of their `IsCancelledMessage`, a mutex in shared memory already unmapped."""
    for retired in [value for value in vars(model).values() if isinstance(value, Retired)]:
        retired.release()  # the loop variable ends on an emptied Retired, not on an attribute gc must free
    model.__dict__.clear()
    gc.collect()


def request_arrays(pb_utils, request, names) -> dict[str, np.ndarray]:
    """{name: numpy array} of the inputs of a Triton request that are present (optional ones may be absent)."""
    arrays = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy()
    return arrays


def triton_error(pb_utils, exc: BaseException, stage: str):
    """The `pb_utils.TritonError` a stage answers `exc` with: the Triton code of its kind and the message with
    the kind's header (`StageError.of`: ValueError -> INVALID_ARG naming a FieldError's field, StageError -> its
    own kind, anything else -> INTERNAL "<stage> failed: ...")."""
    error = StageError.of(exc, stage)
    return pb_utils.TritonError(error.wire(), getattr(pb_utils.TritonError, error.kind.triton_code))


def response(pb_utils, outputs: dict[str, np.ndarray]):
    """An InferenceResponse carrying `outputs` (tensor name -> array)."""
    return pb_utils.InferenceResponse([pb_utils.Tensor(name, array) for name, array in outputs.items()])


def respond_each(pb_utils, requests, names, run: Callable[[dict], dict], stage: str) -> list:
    """One InferenceResponse per request: `run(arrays) -> {name: array}`; an exception becomes that request's
    error (`triton_error`)."""
    return respond_batch(pb_utils, requests, names, lambda batch: [_outcome(run, arrays) for arrays in batch], stage)


def respond_batch(pb_utils, requests, names, run_batch: Callable[[list[dict]], list], stage: str) -> list:
    """One InferenceResponse per request of a dynamic batch run together.

    Args:
        run_batch: the requests' input arrays -> one result per request, in order: its output arrays, or the
            exception that request alone ends with (one bad item fails only its own request). An exception
            raised by `run_batch` itself fails the whole batch.
    """
    try:
        results = run_batch([request_arrays(pb_utils, request, names) for request in requests])
    except Exception as exc:
        results = [exc] * len(requests)
    return [pb_utils.InferenceResponse(error=triton_error(pb_utils, result, stage))
            if isinstance(result, BaseException) else response(pb_utils, result) for result in results]


def _outcome(run: Callable[[dict], dict], arrays: dict):
    try:
        return run(arrays)
    except Exception as exc:
        return exc


class StageModel:
    """The `TritonPythonModel` of a stage that answers each request at once (`respond_each`) or each dynamic batch
    together (`respond_batch`, `BATCHED`). A model.py subclasses it and says what its stage is:

    - `NAME`: the stage's name in INTERNAL errors;
    - `build(parameters)`: the stage object from the model's string parameters (`self.pb_utils` and `self.args`
      are set before), whose `input_names`, `run(arrays)` and `run_batch([arrays, ...])` it answers with unless
      the subclass overrides those three.
    """

    NAME = ""
    BATCHED = False

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils  # exists only inside a stub process

        self.pb_utils, self.args = pb_utils, args
        self.stage = self.build(string_parameters(args))
        self.heartbeat = start_heartbeat(pb_utils, args)

    def build(self, parameters: dict[str, str]):
        return None

    def input_names(self) -> tuple[str, ...]:
        return self.stage.input_names

    def run(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.stage.run(arrays)

    def run_batch(self, batch: list[dict[str, np.ndarray]]) -> list:
        return self.stage.run_batch(batch)

    def execute(self, requests) -> list:
        if self.BATCHED:
            return respond_batch(self.pb_utils, requests, self.input_names(), self.run_batch, self.NAME)
        return respond_each(self.pb_utils, requests, self.input_names(), self.run, self.NAME)

    def finalize(self) -> None:
        try:
            self.heartbeat.stop()
        finally:
            release_python_objects(self)


RETIRE_AFTER_S = 5.0  # those other threads let go within milliseconds
RELEASE_AFTER_S = 0.5  # at finalize no request is in flight: the last sender's thread is done well within this


class Retired:
    """Objects done with, each released RETIRE_AFTER_S after `add`, from this object's thread.

    A response sender is one: after its final flag, the server's thread that answered its last `is_cancelled()`
    still unlocks a mutex in shared memory that the sender frees with itself (python_backend 24.10, as its main
    branch), so a sender freed at once can let that thread write into freed memory. Kept a few seconds and freed
    from here, with the GIL, it is released after that thread is done."""

    def __init__(self):
        self._items: collections.deque = collections.deque()  # (time.monotonic() at add, object)
        threading.Thread(target=self._loop, name="bls-retired", daemon=True).start()

    def add(self, item) -> None:
        self._items.append((time.monotonic(), item))

    def release(self) -> None:
        """Free every object now, once the newest is RELEASE_AFTER_S old (a model's finalize: its requests are
        over, and the stub's shared memory must still be there when the senders free theirs)."""
        if self._items:
            time.sleep(max(0.0, self._items[-1][0] + RELEASE_AFTER_S - time.monotonic()))
        self._items.clear()

    def _loop(self) -> None:
        while True:
            time.sleep(1.0)
            cutoff = time.monotonic() - RETIRE_AFTER_S
            try:
                while self._items[0][0] < cutoff:
                    self._items.popleft()
            except IndexError:  # empty, or emptied by `release`
                pass


class StreamSender:
    """One decoupled request's response sender.

    Args:
        pb_utils: the stub's module.
        sender: `request.get_response_sender()`.
        stage: the stage's name, for INTERNAL errors' messages.
        retired: where the sender goes after its final flag (`Retired`), for a model that asks `is_cancelled()`;
            None: released with this object.
    """

    def __init__(self, pb_utils, sender, stage: str, retired: Retired | None = None):
        self.pb_utils, self.sender, self.stage, self.retired = pb_utils, sender, stage, retired

    def _final(self, response=None) -> None:
        try:
            if response is None:
                self.sender.send(flags=self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                self.sender.send(response, flags=self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            if self.retired is not None:
                self.retired.add(self.sender)

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None:
        """One response; `final` also ends the stream."""
        if final:
            self._final(response(self.pb_utils, outputs))
        else:
            self.sender.send(response(self.pb_utils, outputs), flags=0)

    def fail(self, exc: BaseException) -> None:
        """End the stream with the error `exc` stands for (`triton_error`)."""
        self._final(self.pb_utils.InferenceResponse(error=triton_error(self.pb_utils, exc, self.stage)))

    def close(self) -> None:
        """End the stream with the final flag alone (after a cancellation, or when there is nothing to say)."""
        self._final()

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()
