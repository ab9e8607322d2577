"""Client helpers for tests: free ports, inputs for the omni_chat/preprocess tensors, gRPC streaming, HTTP generate."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np

from omni_backend.vocabulary import PROMPT_TENSORS, SAMPLING_FIELDS

# Triton datatype of every omni_chat / preprocess input (the request vocabulary's).
INPUT_TYPES = {**PROMPT_TENSORS, **{field.tensor: field.datatype for field in SAMPLING_FIELDS}}
NUMPY_TYPES = {"BYTES": np.object_, "INT32": np.int32, "BOOL": np.bool_, "FP32": np.float32, "UINT64": np.uint64}


def make_inputs(values: dict, client_module):
    """tritonclient InferInputs from `{tensor name: value}`.

    Scalars become shape [1]; `stop_words` takes a list; `text_input` may be bytes (sent as they are).
    """
    inputs = []
    for name, value in values.items():
        datatype = INPUT_TYPES[name]
        items = value if isinstance(value, (list, tuple)) else [value]
        if datatype == "BYTES":
            array = np.array([v if isinstance(v, bytes) else str(v).encode("utf-8") for v in items], dtype=np.object_)
        else:
            array = np.array(items, dtype=NUMPY_TYPES[datatype])
        infer_input = client_module.InferInput(name, list(array.shape), datatype)
        infer_input.set_data_from_numpy(array)
        inputs.append(infer_input)
    return inputs


@dataclass
class StreamResult:
    """What one gRPC streamed request returned.

    Attributes:
        responses: one dict per non-empty response: tensor name -> numpy array.
        error: the error message if the request failed, else None.
    """

    responses: list[dict] = field(default_factory=list)
    error: str | None = None

    @property
    def deltas(self) -> list[str]:
        """Each response's text_output, decoded strictly (a broken UTF-8 sequence fails the test)."""
        return [r["text_output"].reshape(-1)[0].decode("utf-8") for r in self.responses if "text_output" in r]

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    def last(self, name: str):
        """The last response's value of a shape [1] output (bytes decoded)."""
        value = self.responses[-1][name].reshape(-1)[0]
        return value.decode("utf-8") if isinstance(value, bytes) else value.item()


OUTPUT_NAMES = ("text_output", "finish_reason", "prompt_tokens", "completion_tokens", "output_logprobs")


def stream_infer(grpc_url: str, values: dict, model: str = "omni_chat", timeout_s: float = 180.0) -> StreamResult:
    """Send one request (`{tensor name: value}`, see make_inputs) over a gRPC stream and collect its responses until
    the final one (or an error).

    Raises:
        TimeoutError: no final response within `timeout_s`.
    """
    import tritonclient.grpc as grpcclient

    return stream_inputs(grpc_url, make_inputs(values, grpcclient), model, timeout_s)


def stream_inputs(grpc_url: str, inputs: list, model: str, timeout_s: float = 180.0,
                  parameters: dict | None = None) -> StreamResult:
    """`stream_infer` for tritonclient InferInputs, with optional request `parameters`."""
    import tritonclient.grpc as grpcclient

    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    result = StreamResult()
    try:
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        client.async_stream_infer(model, inputs, enable_empty_final_response=True, parameters=parameters)
        while True:
            try:
                response, error = events.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no final response from {model} within {timeout_s} s") from None
            if error is not None:
                result.error = error.message() if hasattr(error, "message") else str(error)
                return result
            message = response.get_response()
            if message.outputs:
                result.responses.append({o.name: response.as_numpy(o.name) for o in message.outputs})
            if message.parameters["triton_final_response"].bool_param:
                return result
    finally:
        client.stop_stream()
        client.close()


def http_generate(http_url: str, body: dict, model: str = "omni_chat", timeout_s: float = 180.0):
    """POST `/v2/models/<model>/generate` with a JSON body; returns (HTTP status, decoded JSON body)."""
    request = urllib.request.Request(
        f"http://{http_url}/v2/models/{model}/generate", data=json.dumps(body).encode("utf-8"),
        headers={"Content-Type": "application/json"}, method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def chat_messages(*user_texts: str) -> str:
    """An OpenAI-style messages JSON array with one user message per text."""
    return json.dumps([{"role": "user", "content": text} for text in user_texts])
