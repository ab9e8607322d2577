"""The entry points' Triton side (omni_backend/stages/bls.py) against a stand-in for triton_python_backend_utils:
BLS streams end at the final flag and are drained when closed early, errors keep their message and code, and what
python_backend still touches after use (finished iterators, senders after their final flag) is retired, not freed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from omni_backend.stages.bls import BlsStages, Retired, SenderClient
from omni_backend.stages.entry_points import StageFailure
from omni_backend.stages.tensors import string_tensor
from omni_backend.vocabulary import ErrorKind, StageError

FINAL = 1


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, array

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class Response:
    def __init__(self, output_tensors=(), error=None):
        self._tensors, self._error = list(output_tensors), error

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error

    def output_tensors(self):
        return self._tensors


class Error:
    INVALID_ARG, INTERNAL, UNAVAILABLE = 3, 13, 14

    def __init__(self, message, code=13):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class Iterator:
    """A BLS response iterator: yields its responses once; `consumed` counts those taken."""

    def __init__(self, responses):
        self.responses, self.consumed = list(responses), 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.consumed == len(self.responses):
            raise StopIteration
        self.consumed += 1
        return self.responses[self.consumed - 1]


def fake_pb_utils(answers: dict):
    """`answers`: model -> list of Responses (a decoupled model's stream) or one Response."""
    sent = []

    class InferenceRequest:
        def __init__(self, model_name, inputs, requested_output_names, request_id):
            sent.append((model_name, {t.name(): t.as_numpy() for t in inputs}, requested_output_names, request_id))
            self.model = model_name

        def exec(self, decoupled=False):
            answer = answers[self.model]
            if decoupled:
                iterator = Iterator(answer)
                answers.setdefault("_iterators", []).append(iterator)
                return iterator
            return answer

    return SimpleNamespace(InferenceRequest=InferenceRequest, Tensor=Tensor, sent=sent,
                           InferenceResponse=lambda output_tensors=(), error=None: Response(output_tensors, error),
                           TritonError=Error, TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL)


class KeepAll(Retired):
    """Retired without its release thread: keeps everything, for inspection."""

    def __init__(self):
        self.items = []

    def add(self, item):
        self.items.append(item)


def text(value: str) -> Tensor:
    return Tensor("text_output", string_tensor(value))


def test_a_stream_yields_each_response_with_outputs_until_the_final_flag_and_is_retired():
    answers = {"llm": [Response([text("a")]), Response([text("b")]), Response()]}  # the last: the final flag alone
    retired = KeepAll()
    stages = BlsStages(fake_pb_utils(answers), retired)
    got = [out["text_output"][0] for out in stages.stream("llm", {"input_ids": np.array([1], np.int32)},
                                                         ("text_output",), "r1")]
    assert got == [b"a", b"b"]
    assert retired.items == answers["_iterators"]  # kept, to be freed later with the GIL


def test_closing_a_stream_early_drains_it_before_retiring_it():
    answers = {"llm": [Response([text(str(i))]) for i in range(5)] + [Response()]}
    retired = KeepAll()
    stream = BlsStages(fake_pb_utils(answers), retired).stream("llm", {}, (), "")
    assert next(stream)["text_output"][0] == b"0"
    stream.close()
    iterator = answers["_iterators"][0]
    assert iterator.consumed == 6 and retired.items == [iterator]


def test_a_stage_error_keeps_its_message_and_code():
    answers = {"llm": [Response([text("a")]), Response(error=Error("[queue_full retry_after=1] full", 14))],
               "preprocess": Response(error=Error("[invalid_argument field=max_tokens] max_tokens ...", 3))}
    stages = BlsStages(fake_pb_utils(answers), KeepAll())
    with pytest.raises(StageFailure) as unary:
        stages.infer("preprocess", {}, ("input_ids",), "")
    assert (unary.value.message, unary.value.code) == ("[invalid_argument field=max_tokens] max_tokens ...", 3)
    with pytest.raises(StageFailure) as streamed:
        list(stages.stream("llm", {}, (), ""))
    assert (streamed.value.message, streamed.value.code) == ("[queue_full retry_after=1] full", 14)


class Sender:
    def __init__(self):
        self.sent = []

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))


def test_the_client_retires_its_sender_once_the_final_flag_went():
    pb = fake_pb_utils({})
    for end in ("final", "fail", "close", "stage_failure"):
        sender, retired = Sender(), KeepAll()
        client = SenderClient(pb, sender, "omni_chat", retired)
        client.send({"text_output": string_tensor("a")}, final=False)
        assert retired.items == []
        if end == "final":
            client.send({"text_output": string_tensor("b")}, final=True)
        elif end == "fail":
            client.fail(StageError(ErrorKind.UNAVAILABLE, "server is shutting down"))
        elif end == "stage_failure":
            client.fail(StageFailure("[invalid_argument] bad", 3))
        else:
            client.close()
        assert [flags for _, flags in sender.sent] == [0, FINAL] and retired.items == [sender], end
        last = sender.sent[-1][0]
        if end == "fail":
            assert last.error().message() == "[unavailable] server is shutting down"
        elif end == "stage_failure":
            assert (last.error().message(), last.error().code()) == ("[invalid_argument] bad", 3)
        elif end == "close":
            assert last is None
