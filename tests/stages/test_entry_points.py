"""The streaming entry points' pipeline (omni_backend/stages/entry_points.py) without a server: stages in memory,
the client a list. What each stage was asked, what the client got, and how a cancellation ends the llm generation."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from omni_backend.stages.entry_points import EntryPoint, StageFailure, Steps
from omni_backend.stages.tensors import string_tensor
from omni_backend.vocabulary import ErrorKind, StageError

CHAT = Steps(preprocess="preprocess", llm="llm", postprocess="postprocess")
MM = Steps(preprocess="preprocess", llm="llm", postprocess="postprocess", media="media_embed")
SPEECH = Steps(preprocess="preprocess", llm="llm", media="media_embed", speech_options="speech_options", tts="tts")
VOICE = Steps(preprocess="preprocess", llm="llm", media="media_embed", speech_options="speech_options", tts="tts",
              voice="voice")
IMAGE = '[{"kind": "image", "tokens": 2, "items": 1}]'


def llm_response(text: str, finish: str = "", tokens: int = 1, logprobs: str = "") -> dict:
    return {"text_output": string_tensor(text), "finish_reason": string_tensor(finish),
            "prompt_tokens": np.array([5], np.int32), "completion_tokens": np.array([tokens], np.int32),
            "cached_tokens": np.array([0], np.int32), "output_logprobs": string_tensor(logprobs),
            "prompt_token_logprobs": string_tensor("")}


def text(outputs: dict) -> str:
    return outputs["text_output"].reshape(-1)[0].decode()


class FakeStages:
    """Stages in memory. `llm` yields `llm_responses` (pausing `gap_s` before each); a cancel request for the
    running generation's stream_key ends it, as the llm stage does. Every call is recorded in `calls`."""

    def __init__(self, llm_responses: list[dict], gap_s: float = 0.0, media_parts: str = "[]"):
        self.llm_responses, self.gap_s, self.media_parts = llm_responses, gap_s, media_parts
        self.calls: list[tuple[str, dict]] = []
        self.cancelled_keys: list[str] = []
        self.llm_ended = threading.Event()
        self.failing: dict[str, StageFailure] = {}
        self.chunks = 0  # voice chunks made

    def infer(self, model, inputs, outputs, request_id):
        self.calls.append((model, inputs))
        if model in self.failing:
            raise self.failing[model]
        if model == "speech_options":
            return {"options": string_tensor(json.dumps({"voice": "joe", "stream": "s1"}))}
        if model == "preprocess":
            prepared = {"input_ids": np.array([1, 2, 3], np.int32), "sampling_params": string_tensor("{}"),
                        "media_parts": string_tensor(self.media_parts), "media_positions": np.zeros(0, np.int32),
                        "pixel_values": np.zeros((0, 3, 4, 4), np.float32),
                        "input_features": np.zeros((0, 2, 2), np.float32),
                        "prompt_positions": np.zeros((3, 0), np.int32)}
            return {name: prepared[name] for name in outputs}
        if model == "media_embed":
            return {"prompt_embeds": np.ones((2, 8), np.float32), "prompt_embed_positions": np.array([0, 1], np.int32)}
        if model == "postprocess":
            return {**inputs, "output_logprobs": string_tensor("converted")}
        raise AssertionError(model)

    def stream(self, model, inputs, outputs, request_id):
        self.calls.append((model, inputs))
        if model == "llm" and "cancel" in inputs:
            self.cancelled_keys.append(inputs["cancel"][0].decode())
            return
        if model == "voice":
            yield from self.voice(inputs)
            return
        if model == "tts":
            said = text({"text_output": inputs["text"]})
            if "." in said or inputs["finish_reason"][0]:
                yield {"text_output": string_tensor(said), "audio": np.zeros(3, np.int16),
                       "finish_reason": inputs["finish_reason"]}
            return
        key = inputs["stream_key"][0].decode()
        try:
            for response in self.llm_responses:
                time.sleep(self.gap_s)
                if key in self.cancelled_keys:
                    return  # the llm stage ends a cancelled generation with the final flag alone
                yield response
        finally:
            self.llm_ended.set()


    def voice(self, inputs):
        """The voice stage: a check refuses voices but Chelsie; a push yields one chunk of as many samples as it
        had rows (the last one: two, the second final); a cancel ends the answer."""
        if "cancel" in inputs or "stream_key" not in inputs:
            if inputs.get("voice", [b"Chelsie"])[0] != b"Chelsie":
                raise StageFailure("[invalid_argument field=voice] voice 'x' is not a voice of this model; its "
                                   "voices: Chelsie, Ethan", 3)
            return
        rows = inputs["hidden_states"].shape[0] if "hidden_states" in inputs else 0
        last = bool(inputs["finish_reason"][0])
        for i in range(2 if last else 1):
            time.sleep(self.gap_s)
            self.chunks += 1
            yield {"waveform": np.full(rows + 1, 0.5, np.float32), "sample_rate": np.array([24000], np.int32),
                   "chunk_index": np.array([self.chunks - 1], np.int32),
                   "finish_reason": string_tensor("stop" if last and i == 1 else "")}


def voiced(text_delta: str, rows: int, finish: str = "") -> dict:
    return {**llm_response(text_delta, finish), "hidden_states": np.ones((rows, 4), np.float32),
            "input_embeds": np.zeros((rows, 4), np.float32)}


class ListClient:
    """A Client in memory; `cancel_after`: is_cancelled() is True once that many responses were sent. Each
    is_cancelled() takes 2 ms (an IPC round trip); `late_polls` counts those that overlapped or followed the final
    flag (tritonserver dies of one: see entry_points._Request)."""

    def __init__(self, cancel_after: int | None = None):
        self.sent: list[tuple[dict, bool]] = []
        self.errors: list = []
        self.closed = 0
        self.cancel_after = cancel_after
        self.done = threading.Event()
        self.late_polls = 0
        self.polling = 0

    def send(self, outputs, final):
        assert not self.done.is_set(), "sent after the final flag"
        self.sent.append((outputs, final))
        if final:
            self._final()

    def fail(self, error):
        assert not self.done.is_set(), "failed after the final flag"
        self.errors.append(error)
        self._final()

    def close(self):
        assert not self.done.is_set(), "closed after the final flag"
        self.closed += 1
        self._final()

    def _final(self):
        self.late_polls += self.polling
        self.done.set()

    def is_cancelled(self):
        self.polling += 1
        self.late_polls += self.done.is_set()
        time.sleep(0.002)
        self.polling -= 1
        return self.cancel_after is not None and len(self.sent) >= self.cancel_after


@pytest.fixture
def run():
    entries = []

    def start(steps, stages, client, arrays=None, poll_interval_s=0.01):
        entry = EntryPoint("omni_chat", steps, stages, poll_interval_s=poll_interval_s)
        entries.append(entry)
        entry.submit(arrays or {"text_input": string_tensor("hi")}, client, "req-1").join(timeout=10)
        assert client.done.is_set(), "the client's stream did not end"
        assert entry.num_active == 0
        time.sleep(3 * poll_interval_s)
        assert client.late_polls == 0, "is_cancelled() was asked after the final flag"
        return entry

    yield start
    for entry in entries:
        entry.shutdown()


def test_chat_streams_every_llm_response_and_the_last_is_final_without_postprocess(run):
    stages = FakeStages([llm_response("The"), llm_response(" capital", tokens=2),
                         llm_response(" is Paris.", "stop", tokens=3)])
    client = ListClient()
    run(CHAT, stages, client)
    assert [(text(o), final) for o, final in client.sent] == [("The", False), (" capital", False),
                                                              (" is Paris.", True)]
    assert [model for model, _ in stages.calls] == ["preprocess", "llm"]  # no logprobs: postprocess skipped
    llm_inputs = stages.calls[1][1]
    assert set(llm_inputs) == {"input_ids", "sampling_params", "stream_key"}
    assert llm_inputs["stream_key"][0].decode().startswith("omni_chat-")
    assert not stages.cancelled_keys and not client.errors and not client.closed


def test_responses_with_logprobs_go_through_postprocess(run):
    stages = FakeStages([llm_response("Hi", logprobs='[{"id": 1}]'), llm_response("!", "length", tokens=2)])
    client = ListClient()
    run(CHAT, stages, client)
    assert [model for model, _ in stages.calls] == ["preprocess", "llm", "postprocess"]
    assert client.sent[0][0]["output_logprobs"][0] == b"converted" and client.sent[1][1]


def test_media_embed_runs_only_for_requests_with_media(run):
    text_only = FakeStages([llm_response("ok", "stop")])
    run(MM, text_only, ListClient())
    assert [model for model, _ in text_only.calls] == ["preprocess", "llm"]
    with_image = FakeStages([llm_response("ok", "stop")], media_parts=IMAGE)
    run(MM, with_image, ListClient())
    assert [model for model, _ in with_image.calls] == ["preprocess", "media_embed", "llm"]
    assert {"prompt_embeds", "prompt_embed_positions"} <= set(with_image.calls[2][1])


def test_speech_sends_each_llm_delta_to_tts_and_its_phrases_to_the_client(run):
    stages = FakeStages([llm_response("Hello"), llm_response(" there."), llm_response(" Bye", "stop")])
    client = ListClient()
    run(SPEECH, stages, client, {"text_input": string_tensor("hi"), "voice": string_tensor("joe")})
    assert [model for model, _ in stages.calls] == ["speech_options", "preprocess", "llm", "tts", "tts", "tts"]
    assert "voice" not in stages.calls[1][1] and stages.calls[0][1]["voice"][0] == b"joe"
    options = stages.calls[3][1]["options"]
    assert all(inputs["options"] is options for model, inputs in stages.calls if model == "tts")
    assert [(text(o), final) for o, final in client.sent] == [(" there.", False), (" Bye", True)]


def test_the_watch_never_asks_is_cancelled_after_the_final_flag(run):
    """Many short requests finishing while the watch polls (every 1 ms, each poll taking 2 ms)."""
    for _ in range(50):
        client = ListClient()
        run(CHAT, FakeStages([llm_response("a"), llm_response("b", "stop")]), client, poll_interval_s=0.001)
        assert client.sent[-1][1]


def test_a_stage_error_reaches_the_client_as_it_came(run):
    stages = FakeStages([llm_response("never", "stop")])
    stages.failing["preprocess"] = StageFailure("[invalid_argument field=max_tokens] max_tokens must be ...", 3)
    client = ListClient()
    run(CHAT, stages, client)
    assert client.errors == [stages.failing["preprocess"]] and not client.sent
    assert [model for model, _ in stages.calls] == ["preprocess"]


def test_an_llm_stream_that_ends_without_a_last_response_is_an_internal_error(run):
    client = ListClient()
    run(CHAT, FakeStages([llm_response("cut")]), client)
    assert len(client.errors) == 1 and isinstance(client.errors[0], StageError)
    assert client.errors[0].kind is ErrorKind.INTERNAL and "before its final response" in client.errors[0].message


def test_a_cancelled_request_cancels_its_generation_and_ends_with_the_final_flag_alone(run):
    many = [llm_response("x") for _ in range(200)] + [llm_response("", "length")]
    stages = FakeStages(many, gap_s=0.005)
    client = ListClient(cancel_after=3)
    run(CHAT, stages, client)
    assert client.closed == 1 and not client.errors and not any(final for _, final in client.sent)
    assert len(client.sent) < 50  # the generation stopped within a few responses of the cancel
    key = stages.calls[1][1]["stream_key"][0].decode()
    assert key in stages.cancelled_keys and stages.llm_ended.is_set()


def test_a_cancel_that_overtook_the_generation_is_sent_again_at_its_next_response(run):
    """The watch cancels a generation the llm stage does not hold yet: the request's thread cancels it again when
    the first response arrives."""
    many = [llm_response("x") for _ in range(200)] + [llm_response("", "length")]
    stages = FakeStages(many, gap_s=0.005)
    lost = []
    real_stream = stages.stream

    def first_cancel_lost(model, inputs, outputs, request_id):
        if "cancel" in inputs and not lost:
            lost.append(inputs["cancel"][0].decode())
            return iter(())
        return real_stream(model, inputs, outputs, request_id)

    stages.stream = first_cancel_lost
    client = ListClient(cancel_after=2)
    run(CHAT, stages, client)
    assert lost and stages.cancelled_keys == lost and client.closed == 1


def test_a_request_cancelled_before_its_generation_never_starts_it(run):
    stages = FakeStages([llm_response("x", "stop")])
    client = ListClient(cancel_after=0)
    real_infer = stages.infer

    def slow_preprocess(model, inputs, outputs, request_id):
        time.sleep(0.1)  # the watch notices meanwhile
        return real_infer(model, inputs, outputs, request_id)

    stages.infer = slow_preprocess
    run(CHAT, stages, client)
    assert [model for model, _ in stages.calls] == ["preprocess"] and client.closed == 1 and not client.sent


def test_a_failing_client_send_cancels_the_generation(run):
    class GoneClient(ListClient):
        def send(self, outputs, final):
            raise RuntimeError("Unable to send response. Response sender has been closed.")

    stages = FakeStages([llm_response("x") for _ in range(50)] + [llm_response("", "length")])
    client = GoneClient()
    run(CHAT, stages, client)
    assert stages.cancelled_keys and stages.llm_ended.is_set()
    assert client.errors[0].kind is ErrorKind.INTERNAL and "RuntimeError" in client.errors[0].message


@pytest.mark.parametrize("parameters, problem", [
    ({"llm_model": "llm"}, "missing step parameter(s): preprocess_model"),
    ({"preprocess_model": "p", "llm_model": "l", "tts_model": "t"}, "go together"),
    ({"preprocess_model": "p", "llm_model": "l", "vocoder_model": "v"}, "unknown step parameter(s): vocoder_model"),
])
def test_steps_from_parameters_refuse_incomplete_pipelines(parameters, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        Steps.from_parameters(parameters)


def test_the_model_configs_name_their_steps():
    from omni_backend import paths

    def steps(model):
        text = (paths.MODEL_REPOSITORY_TEMPLATES / model / "config.pbtxt").read_text()
        import re
        return Steps.from_parameters(dict(re.findall(r'key: "(\w+_model)" value: \{ string_value: "(\w+)" \}', text)))

    assert steps("omni_chat") == CHAT
    assert steps("omni_chat_mm") == MM
    assert steps("omni_speech") == SPEECH


def test_a_text_only_entry_point_refuses_media_parts_instead_of_answering_without_them(run):
    """omni_chat's preprocess decodes media into placeholder tokens too; without media_embed the llm would read
    them with no embeddings, so the request is refused, naming text_input, and the llm is never called."""
    stages = FakeStages([llm_response("never", "stop")], media_parts=IMAGE)
    client = ListClient()
    run(CHAT, stages, client)
    assert [model for model, _ in stages.calls] == ["preprocess"] and client.sent == []
    (error,) = client.errors
    assert (error.kind, error.field) == (ErrorKind.INVALID_ARGUMENT, "text_input")
    assert "omni_chat_mm" in error.message


def test_a_model_with_a_talker_speaks_through_the_voice_stage(run):
    """Voice check first, then preprocess and llm (asked for hidden states, every output), each llm response's rows
    to voice (the first with the voice, seed and prompt length), text and audio to the client as they come, the last
    response after the last chunk; speech_options and tts are not called."""
    stages = FakeStages([voiced("Hi", 6), voiced(" there", 1), voiced("", 0, "stop")])
    real_infer = stages.infer

    def seeded(model, inputs, outputs, request_id):
        answer = real_infer(model, inputs, outputs, request_id)
        if model == "preprocess":
            answer["sampling_params"] = string_tensor('{"seed": 5, "max_tokens": 3}')
        return answer

    stages.infer = seeded
    client = ListClient()
    run(VOICE, stages, client, {"text_input": string_tensor("hi"), "voice": string_tensor("Chelsie"),
                                "audio_format": string_tensor("wav")})
    assert [model for model, _ in stages.calls] == ["voice", "preprocess", "llm", "voice", "voice", "voice"]
    llm = stages.calls[2][1]
    assert json.loads(llm["sampling_params"][0]) == {"seed": 5, "max_tokens": 3, "return_hidden_states": True,
                                                     "stream": True}
    pushes = [inputs for model, inputs in stages.calls[3:]]
    assert {p["stream_key"][0] for p in pushes} == {llm["stream_key"][0]}
    assert pushes[0]["voice"][0] == b"Chelsie" and pushes[0]["seed"].tolist() == [5]
    assert pushes[0]["prompt_tokens"].tolist() == [5] and "voice" not in pushes[1]
    assert not {"prompt_positions", "media_positions"} & set(pushes[0])  # a text prompt: 1-D positions
    assert [p["hidden_states"].shape[0] for p in pushes[:2]] == [6, 1] and "hidden_states" in pushes[2]
    kinds = [("text", text(o)) if "waveform" not in o else ("audio", o["waveform"].size) for o, _ in client.sent]
    assert kinds == [("text", "Hi"), ("audio", 7), ("text", " there"), ("audio", 2), ("audio", 1), ("audio", 1),
                     ("text", "")]
    audio = client.sent[1][0]
    assert audio["audio"].dtype == np.int16 and audio["audio"].tolist() == [16384] * 7
    last, final = client.sent[-1]
    assert final and last["finish_reason"][0] == b"stop" and last["completion_tokens"].tolist() == [1]
    assert [final for _, final in client.sent[:-1]] == [False] * 6 and not stages.cancelled_keys


def test_a_spoken_answer_to_a_prompt_with_media_gives_the_voice_its_positions(run):
    """An image prompt through omni_speech with a talker: media_embed's embeddings go to the llm with the prompt's
    M-RoPE ids, and the answer's first voice request carries those ids and the placeholders' positions
    (media_embed's `prompt_embed_positions`, whose input embeddings the talker reads as zero); later ones neither."""
    stages = FakeStages([voiced("Hi", 6), voiced("", 0, "stop")], media_parts=IMAGE)
    positions = np.arange(15, dtype=np.int32).reshape(3, 5)
    real_infer = stages.infer

    def with_positions(model, inputs, outputs, request_id):
        answer = real_infer(model, inputs, outputs, request_id)
        if model == "preprocess":
            answer["prompt_positions"] = positions
        return answer

    stages.infer = with_positions
    client = ListClient()
    run(VOICE, stages, client, {"text_input": string_tensor("hi"), "voice": string_tensor("Chelsie")})
    assert not client.errors and client.sent[-1][1]
    assert [model for model, _ in stages.calls] == ["voice", "preprocess", "media_embed", "llm", "voice", "voice"]
    llm = stages.calls[3][1]
    assert llm["prompt_embeds"].shape == (2, 8) and np.array_equal(llm["prompt_positions"], positions)
    first, last = stages.calls[4][1], stages.calls[5][1]
    assert np.array_equal(first["prompt_positions"], positions) and first["media_positions"].tolist() == [0, 1]
    assert not {"prompt_positions", "media_positions", "voice"} & set(last)


def test_an_unknown_voice_or_speed_is_refused_before_the_llm_runs(run):
    stages = FakeStages([voiced("never", 2, "stop")])
    client = ListClient()
    run(VOICE, stages, client, {"text_input": string_tensor("hi"), "voice": string_tensor("Nobody")})
    assert "Chelsie, Ethan" in client.errors[0].message and [m for m, _ in stages.calls] == ["voice"]
    client = ListClient()
    run(VOICE, stages, client, {"text_input": string_tensor("hi"), "voice": string_tensor("Chelsie"),
                                "speed": np.array([1.5], np.float32)})
    assert client.errors[0].field == "speed" and [m for m, _ in stages.calls] == ["voice"]


def test_a_cancelled_spoken_answer_ends_in_the_llm_and_the_voice_stage(run):
    stages = FakeStages([voiced("x", 1) for _ in range(200)] + [voiced("", 0, "length")], gap_s=0.005)
    client = ListClient(cancel_after=4)
    run(VOICE, stages, client, {"text_input": string_tensor("hi"), "voice": string_tensor("Chelsie")})
    assert client.closed == 1 and not client.errors and len(client.sent) < 50
    key = stages.calls[2][1]["stream_key"][0]
    cancels = [(model, inputs["cancel"][0]) for model, inputs in stages.calls if "cancel" in inputs]
    assert ("llm", key) in cancels and [c for c in cancels if c[0] == "voice"] == [("voice", key)]
    assert stages.llm_ended.is_set()
