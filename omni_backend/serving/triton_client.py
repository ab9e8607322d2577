"""The front door's gRPC client side of Triton: one asyncio client per event loop, unary calls that a cancelled
caller never cancels on the wire, one-request streams that a caller leaving early cancels, and numeric tensors whose
values never wrap."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aio
from tritonclient.utils import InferenceServerException

from omni_backend.serving.errors import call_failed, invalid
from omni_backend.vocabulary import tensor_value_problem

READY_TIMEOUT_S = 2.0  # a readiness check waits no longer for a stage's server (one that is down must not stall it)
_UNARY_CALLS: set[asyncio.Task] = set()  # unary calls running on after their caller was cancelled


async def infer_to_completion(client: aio.InferenceServerClient, model_name: str, inputs: list, **kwargs):
    """`client.infer(model_name, inputs, **kwargs)`, but a cancelled caller never cancels the call on the wire.

    Why: Triton 2.51's unary gRPC handler (ModelInferHandler) can free a call's state while a cancellation of that
    call is still being processed; the whole server then dies with signal 11 in `ModelInferHandler::Process`
    (reproduced here: a storm of HTTP clients leaving right after sending made the front door cancel preprocess
    and postprocess calls; Triton issues #7368 and #8034, fixed upstream by server PRs #7840 (24.12) and #8078
    (25.04); the frame symbolised from the unstripped tritonserver binary). It is rare and timing-bound: before
    this, one storm run of three died within 400 disconnects while the others survived 1,200 and 2,400; after it,
    1,600 immediate disconnects and the storm test (tests/reliability/test_cancel_storm.py) without a crash; no
    test can prove its absence. Unary calls are short (tokenizing, one postprocess step, one encoder pass), so
    when the caller is cancelled the call runs to its end in the background and its result is dropped. The llm
    stream is still cancelled (Triton's stream handler survived 1,000 immediate cancels, and cancelling it is what
    frees KV blocks).

    Raises:
        what `client.infer` raises (InferenceServerException, grpc errors); asyncio.CancelledError when the
        caller is cancelled (the call itself goes on).
    """
    call = asyncio.ensure_future(client.infer(model_name, inputs, **kwargs))
    _UNARY_CALLS.add(call)
    call.add_done_callback(_unary_call_done)
    return await asyncio.shield(call)


def _unary_call_done(call: asyncio.Task) -> None:
    _UNARY_CALLS.discard(call)
    if not call.cancelled():
        call.exception()  # mark it retrieved: a dropped call's error is not logged as "never retrieved"


async def stream_one(client: aio.InferenceServerClient, request: dict, to_error: Callable[[str], Exception],
                     last: Callable[[Any], bool], server: tuple[str, str] | None = None) -> AsyncIterator:
    """The results of a gRPC stream that carries `request` alone (`stream_infer`'s request dict), until one that
    `last(result)` calls the last, or the stream's end. An error response raises `to_error(message)`; a stream that
    fails as a whole raises `errors.call_failed` (`server`: the stage and address it went to when not the front
    door's own Triton). Closed before the last result, it cancels the stream (the stage sees its request
    cancelled)."""
    async def one_request():
        yield request

    stream = client.stream_infer(one_request())
    finished = False
    try:
        async for result, error in stream:
            if error is not None:
                finished = True
                raise to_error(error.message())
            finished = last(result)
            yield result
            if finished:
                return
        finished = True
    except grpc.aio.AioRpcError as exc:  # no stage answered it
        finished = True
        raise call_failed(exc.code().name, exc.details(), request["model_name"], server) from None
    finally:
        if not finished:
            stream.cancel()


def numeric_array(items: list, datatype: str, field: str) -> np.ndarray:
    """`items` as a numpy array of a Triton numeric `datatype` ("INT32", "UINT64", "FP32", "BOOL", ...).

    numpy would raise OverflowError for an integer beyond int64, silently wrap one beyond a smaller type
    (max_tokens 2**32 + 5 would become 5) and turn a float beyond float32's range into infinity, so every value
    is checked against the datatype first (`vocabulary.tensor_value_problem`).

    Raises:
        OpenAIError: 400 naming `field` when a value does not fit the tensor's type.
    """
    for value in items:
        problem = tensor_value_problem(datatype, value)
        if problem is not None:
            raise invalid(f"{field} {problem}", field)
    return np.array(items, dtype=np.dtype(grpcclient.triton_to_np_dtype(datatype)))


class TritonGrpcUser:
    """Holds an asyncio Triton gRPC client for `grpc_url`, made on first use: inside the serving event loop, to
    which tritonclient's aio client binds. `close` closes it (a later use makes a new one)."""

    def __init__(self, grpc_url: str):
        self.grpc_url = grpc_url
        self._client: aio.InferenceServerClient | None = None

    @property
    def client(self) -> aio.InferenceServerClient:
        if self._client is None:
            self._client = aio.InferenceServerClient(self.grpc_url)
        return self._client

    async def model_problem(self, model: str) -> str | None:
        """Why `model` cannot serve now (its server does not answer within READY_TIMEOUT_S, or does not have it
        ready), or None when it is ready."""
        try:
            if await self.client.is_model_ready(model, client_timeout=READY_TIMEOUT_S):
                return None
            return f"model {model} is not ready on the tritonserver at {self.grpc_url}"
        except InferenceServerException as exc:
            return f"the tritonserver at {self.grpc_url} does not answer: {exc.message()}"

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
