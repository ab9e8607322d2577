"""gRPC streams straight to the decoupled `llm` model, for tests that need many requests in flight at a known
moment (overload, shutdown): inputs made by the server's own preprocess stage, streams opened before sending."""

from __future__ import annotations

import queue
import time

import tritonclient.grpc as grpcclient
from helpers.chat_client import chat_messages, make_inputs


LLM_INPUTS = (("input_ids", "INT32"), ("sampling_params", "BYTES"))


def preprocessed(grpc_url: str, prompt: str, max_tokens: int, chat: bool = True) -> dict:
    """The server's own preprocess stage's `input_ids` and `sampling_params` arrays for a greedy request
    (`ignore_eos`: exactly max_tokens tokens): `prompt` as a user message (`chat`) or as plain text the model
    continues."""
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        result = client.infer("preprocess", make_inputs(
            {"text_input": chat_messages(prompt) if chat else prompt, "max_tokens": max_tokens, "temperature": 0.0,
             "stream": True, "ignore_eos": True}, grpcclient))
    finally:
        client.close()
    return {name: result.as_numpy(name) for name, _ in LLM_INPUTS}


def llm_inputs(grpc_url: str, prompt: str, max_tokens: int, chat: bool = True) -> list:
    """The llm model's inputs for `preprocessed(...)`'s greedy request."""
    return as_llm_inputs(preprocessed(grpc_url, prompt, max_tokens, chat))


def as_llm_inputs(arrays: dict) -> list:
    """`preprocessed` arrays as the llm model's gRPC inputs."""
    inputs = []
    for name, datatype in LLM_INPUTS:
        tensor = grpcclient.InferInput(name, list(arrays[name].shape), datatype)
        tensor.set_data_from_numpy(arrays[name])
        inputs.append(tensor)
    return inputs


class LLMStream:
    """One gRPC stream to the `llm` model for one request; open it early, so that `send` is all that is left.

    `events` gets (time.monotonic(), result, error) per callback: a test may watch it before `collect`.
    """

    def __init__(self, grpc_url: str):
        self.events: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(grpc_url)
        self.client.start_stream(callback=lambda result, error: self.events.put((time.monotonic(), result, error)))
        self.sent_at = 0.0

    def send(self, inputs: list) -> None:
        self.sent_at = time.monotonic()
        self.client.async_stream_infer("llm", inputs, enable_empty_final_response=True)

    def collect(self, timeout_s: float = 120.0) -> dict:
        """Wait for the final response or the error: {"text", "tokens", "finish_reason", "error", "ended_after_s"}
        (seconds from sending to the end). The stream is closed afterwards.

        Raises:
            queue.Empty: nothing arrived for `timeout_s` seconds.
        """
        text, tokens, finish_reason, ended = [], 0, "", False
        try:
            while True:
                at, result, error = self.events.get(timeout=timeout_s)
                if error is not None:
                    ended = True
                    return {"error": error.message(), "ended_after_s": at - self.sent_at}
                response = result.get_response()
                if response.outputs:
                    text.append(result.as_numpy("text_output")[0].decode("utf-8"))
                    tokens = int(result.as_numpy("completion_tokens")[0])
                    finish_reason = result.as_numpy("finish_reason")[0].decode()
                if response.parameters["triton_final_response"].bool_param:
                    ended = True
                    return {"text": "".join(text), "tokens": tokens, "finish_reason": finish_reason, "error": None,
                            "ended_after_s": at - self.sent_at}
        finally:  # a stream that did not end is cancelled: closing it would wait for the server
            self.client.stop_stream(cancel_requests=not ended)
            self.client.close()
