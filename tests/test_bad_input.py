"""Every bad input gets INVALID_ARG naming the problem, and the server keeps serving."""

import pytest
from chat_client import chat_messages, http_generate, make_inputs, stream_infer

pytestmark = [pytest.mark.server, pytest.mark.reliability]

LONG_PROMPT = "word " * 2100

BAD_INPUTS = {
    "missing text_input": ({"max_tokens": 8}, "text_input"),
    "empty prompt": ({"text_input": "", "max_tokens": 8}, "text_input is empty"),
    "max_tokens zero": ({"text_input": "Hi", "max_tokens": 0}, "max_tokens must be at least 1"),
    "max_tokens negative": ({"text_input": "Hi", "max_tokens": -5}, "max_tokens must be at least 1"),
    "max_tokens above limit": ({"text_input": "Hi", "max_tokens": 100000}, "max_tokens must be at most 2048"),
    "malformed messages": ({"text_input": '[{"role": "user", "content": ', "max_tokens": 8}, "messages JSON"),
    "message without content": ({"text_input": '[{"role": "user"}]', "max_tokens": 8}, "messages[0].content"),
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
    assert_still_serving(triton_server)


@pytest.mark.parametrize("name", [n for n, (v, _) in BAD_INPUTS.items() if not isinstance(v.get("text_input"), bytes)])
def test_bad_input_over_http_generate_is_400(triton_server, name):
    values, fragment = BAD_INPUTS[name]
    status, body = http_generate(triton_server.http_url, values)
    assert status == 400 and fragment in body.get("error", ""), body
