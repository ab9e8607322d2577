"""Every bad input gets INVALID_ARG naming the problem, and the server keeps serving."""

import pytest
from helpers.chat_client import chat_messages, http_generate, stream_infer

from omni_backend.vocabulary import ErrorKind, StageError

pytestmark = [pytest.mark.server, pytest.mark.reliability]

LONG_PROMPT = "word " * 2100

BAD_INPUTS = {
    "missing text_input": ({"max_tokens": 8}, "text_input"),
    "empty prompt": ({"text_input": "", "max_tokens": 8}, "text_input is empty"),
    "max_tokens zero": ({"text_input": "Hi", "max_tokens": 0}, "max_tokens must be an integer in [1, inf)"),
    "max_tokens negative": ({"text_input": "Hi", "max_tokens": -5}, "max_tokens must be an integer in [1, inf)"),
    "max_tokens above limit": ({"text_input": "Hi", "max_tokens": 100000}, "max_tokens must be at most 2048"),
    "malformed messages": ({"text_input": '[{"role": "user", "content": ', "max_tokens": 8}, "messages JSON"),
    "message without content": ({"text_input": '[{"role": "user"}]', "max_tokens": 8}, "text_input[0].content"),
    "non-UTF-8 text": ({"text_input": b"caf\xe9 \xff", "max_tokens": 8}, "not valid UTF-8"),
    "prompt too long": ({"text_input": LONG_PROMPT, "max_tokens": 16}, "maximum context length is 2048 tokens"),
    "temperature out of range": ({"text_input": "Hi", "max_tokens": 8, "temperature": 9.0}, "temperature"),
}


def assert_still_serving(server):
    result = stream_infer(server.grpc_url, {"text_input": chat_messages("Say hi."), "max_tokens": 4, "stream": True})
    assert result.error is None and result.text


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_over_grpc_stream(triton_server, name):
    values, fragment = BAD_INPUTS[name]
    result = stream_infer(triton_server.grpc_url, values)
    assert result.error is not None and fragment in result.error, result.error
    assert not result.responses
    if name != "missing text_input":  # Triton's own error; the rest are preprocess's, with their kind's header
        kind = StageError.parse(result.error).kind
        assert kind is (ErrorKind.CONTEXT_LENGTH_EXCEEDED if name == "prompt too long" else
                        ErrorKind.INVALID_ARGUMENT), result.error
    assert_still_serving(triton_server)


@pytest.mark.parametrize("values, field", [
    ({"text_input": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "Hi", "max_tokens": 8, "random_seed": 2**64 - 1}, "random_seed"),
    ({"text_input": '[{"role": "user"}]', "max_tokens": 8}, "text_input[0].content"),
])
def test_errors_name_their_field_as_data(triton_server, values, field):
    """The field travels in the message's header (omni_backend.vocabulary), so a client never parses wording."""
    error = StageError.parse(stream_infer(triton_server.grpc_url, values).error)
    assert (error.kind, error.field) == (ErrorKind.INVALID_ARGUMENT, field)
    assert error.message.startswith(field + " ")


@pytest.mark.parametrize("name", [n for n, (v, _) in BAD_INPUTS.items() if not isinstance(v.get("text_input"), bytes)])
def test_bad_input_over_http_generate_is_400(triton_server, name):
    values, fragment = BAD_INPUTS[name]
    status, body = http_generate(triton_server.http_url, values)
    assert status == 400 and fragment in body.get("error", ""), body
