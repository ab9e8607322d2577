"""The preprocess and postprocess stage models on a real tritonserver, without the LLM."""

import json

import numpy as np
import pytest
from helpers.chat_client import chat_messages, make_inputs
from test_bad_input import BAD_INPUTS

pytestmark = pytest.mark.server


def test_preprocess_tokenizes_messages(stages_server):
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(stages_server.grpc_url) as client:
        result = client.infer("preprocess", make_inputs(
            {"text_input": chat_messages("What is the capital of France?"), "max_tokens": 8, "temperature": 0.0,
             "stop_words": ["\n"]}, grpcclient))
    ids = result.as_numpy("input_ids")
    assert ids.dtype == np.int32 and len(ids) == 37 and ids[0] == 1  # <|im_start|> system ...
    params = json.loads(result.as_numpy("sampling_params")[0])
    assert (params["max_tokens"], params["temperature"], params["stop"]) == (8, 0.0, ["\n"])


@pytest.mark.reliability
@pytest.mark.parametrize("name", [n for n in BAD_INPUTS if n != "missing text_input"])
def test_preprocess_answers_invalid_argument(stages_server, name):
    """gRPC streams carry only the message; a direct (non-decoupled) call shows the status code."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    values, fragment = BAD_INPUTS[name]
    with grpcclient.InferenceServerClient(stages_server.grpc_url) as client:
        with pytest.raises(InferenceServerException) as excinfo:
            client.infer("preprocess", make_inputs(values, grpcclient))
        assert excinfo.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert fragment in excinfo.value.message()
        client.infer("preprocess", make_inputs({"text_input": "Hi", "max_tokens": 4}, grpcclient))  # still serving


def test_postprocess_converts_logprobs(stages_server):
    import tritonclient.http as httpclient

    engine_logprobs = json.dumps([{"id": 4649, "logprob": -0.5, "top": [[4649, -0.5], [47, -1.5]]}])
    inputs = []
    for name, array in {
        "text_output": np.array([" France".encode()], dtype=np.object_),
        "finish_reason": np.array([b"stop"], dtype=np.object_),
        "prompt_tokens": np.array([37], dtype=np.int32),
        "completion_tokens": np.array([1], dtype=np.int32),
        "cached_tokens": np.array([32], dtype=np.int32),
        "output_logprobs": np.array([engine_logprobs.encode()], dtype=np.object_),
    }.items():
        tensor = httpclient.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else "INT32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    with httpclient.InferenceServerClient(stages_server.http_url) as client:
        result = client.infer("postprocess", inputs)
    assert result.as_numpy("text_output").tolist() == [b" France"]
    assert result.as_numpy("finish_reason").tolist() == [b"stop"]
    assert result.as_numpy("cached_tokens").tolist() == [32]
    logprobs = json.loads(result.as_numpy("output_logprobs")[0])
    assert logprobs[0]["token"] == " France" and logprobs[0]["bytes"] == list(b" France")
    assert logprobs[0]["top_logprobs"][1] == {"token": "?", "bytes": [63], "logprob": -1.5}
