"""Image and audio input through the OpenAI front door on a real tritonserver (issue 5 acceptance;
cases c07 and c08 are in tests/reliability/test_cases.py).

The default encoders are random: these tests check the serving path (decode, encode, batch, splice), not what
the model says about the picture.
"""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest
import requests
from helpers.media_inputs import (assert_400, assert_ok, audio_bytes, audio_part, chat, chat_answer, image_bytes,
                          image_part, speech, text_only_prompt_tokens)

from omni_backend.stages.audio import HOP_LENGTH, tokens_for_frames

pytestmark = pytest.mark.server

# The default SmolVLM-shaped model writes an image as <fake_token_around_image><global-img>, 49 <image>,
# <fake_token_around_image>.
IMAGE_TOKENS = 52


@pytest.fixture(scope="module")
def text_only_tokens(mm_front_door):
    return text_only_prompt_tokens(mm_front_door)


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg")])
def test_astronaut_photo_answers_with_text_and_counts_placeholders(mm_front_door, text_only_tokens, fmt, mime):
    status, body = chat(mm_front_door, image_part(image_bytes(fmt), mime))
    assert_ok(status, body)
    assert body["usage"]["prompt_tokens"] == text_only_tokens + IMAGE_TOKENS


def test_speech_wav_answers_with_text_and_counts_placeholders(mm_front_door, text_only_tokens):
    samples, rate = speech()
    status, body = chat(mm_front_door, audio_part(audio_bytes("WAV")), text="What was said?")
    assert_ok(status, body)
    frames = -(-round(samples.size * 16000 / rate) // HOP_LENGTH)
    status, plain = chat(mm_front_door, {"type": "text", "text": ""}, text="What was said?")
    assert body["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + tokens_for_frames(frames, 4)


def _stats(server, model):
    stats = requests.get(f"{server.http_url if server.http_url.startswith('http') else 'http://' + server.http_url}"
                         f"/v2/models/{model}/stats", timeout=10).json()["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def test_concurrent_image_requests_equal_one_by_one_and_batch_in_the_encoder(mm_front_door, mm_server):
    from skimage import data

    photos = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    parts = [image_part(image_bytes("PNG", photo)) for photo in photos]
    one_by_one = [chat_answer(assert_ok(*chat(mm_front_door, part, max_tokens=12))) for part in parts]
    before = _stats(mm_server, "vision_encoder")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda part: chat_answer(assert_ok(*chat(mm_front_door, part, max_tokens=12))),
                                 parts))
    after = _stats(mm_server, "vision_encoder")
    assert together == one_by_one
    inferences, executions = after[0] - before[0], after[1] - before[1]
    assert inferences == 4 and executions < inferences, (inferences, executions)


@pytest.mark.parametrize("parts,param,fragment", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}], "messages[0].content[1]",
     "not valid base64"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], "messages[0].content[1]",
     "not a PNG, JPEG, WebP or GIF image"),
    ([{"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}}], "messages[0].content[1]",
     "disabled"),
    ([image_part(b"x")] * 9, "messages[0].content[9]", "limit is 8 per request"),
])
def test_bad_media_is_a_400_naming_the_part_and_the_next_request_works(mm_front_door, parts, param, fragment):
    assert_400(*chat(mm_front_door, *parts), param, fragment)
    assert_ok(*chat(mm_front_door, text="Say hi."))


def test_omni_chat_mm_ensemble_equals_the_front_door_and_passes_text_through(mm_front_door, mm_server):
    """The ensemble (preprocess -> media_embed -> llm -> postprocess) gives the front door's answer for an image,
    and omni_chat's answer for text only (no encoder call: the encoders' inference counts do not move)."""
    import json

    from helpers.chat_client import stream_infer

    part = image_part(image_bytes("JPEG"), "image/jpeg")
    text, prompt_tokens = chat_answer(assert_ok(*chat(mm_front_door, part, max_tokens=12)))
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, part]}]
    values = {"text_input": json.dumps(messages), "max_tokens": 12, "temperature": 0.0}
    result = stream_infer(mm_server.grpc_url, values, model="omni_chat_mm")
    assert result.error is None, result.error
    assert (result.text, result.last("prompt_tokens")) == (text, prompt_tokens)

    before = [_stats(mm_server, m)[0] for m in ("vision_encoder", "audio_encoder")]
    plain = {"text_input": json.dumps([{"role": "user", "content": "What is the capital of France?"}]),
             "max_tokens": 12, "temperature": 0.0}
    through_mm, through_chat = (stream_infer(mm_server.grpc_url, plain, model=m) for m in ("omni_chat_mm", "omni_chat"))
    assert through_mm.error is None and through_mm.text == through_chat.text and through_mm.text
    assert [_stats(mm_server, m)[0] for m in ("vision_encoder", "audio_encoder")] == before
    bad = dict(values, text_input=json.dumps([{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "bm90IGF1ZGlv", "format": "wav"}}]}]))
    assert "unsupported audio format" in stream_infer(mm_server.grpc_url, bad, model="omni_chat_mm").error


def test_llm_refuses_prompt_embeds_of_the_wrong_hidden_size_and_keeps_serving(mm_front_door, mm_server):
    import json

    import tritonclient.grpc as grpcclient

    def llm_request(hidden):
        arrays = {"input_ids": np.array([1, 2, 3, 4], dtype=np.int32),
                  "sampling_params": np.array([json.dumps({"max_tokens": 2, "temperature": 0.0}).encode()],
                                              dtype=np.object_),
                  "prompt_embeds": np.zeros((2, hidden), dtype=np.float32),
                  "prompt_embed_positions": np.array([1, 2], dtype=np.int32)}
        inputs = []
        for name, array in arrays.items():
            tensor = grpcclient.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else
                                           {"int32": "INT32", "float32": "FP32"}[str(array.dtype)])
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        events = []
        client = grpcclient.InferenceServerClient(mm_server.grpc_url)
        client.start_stream(callback=lambda result, error: events.append((result, error)))
        client.async_stream_infer("llm", inputs)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
                e is not None or r.get_response().parameters["triton_final_response"].bool_param for r, e in events):
            time.sleep(0.05)
        client.stop_stream()
        client.close()
        return events

    events = llm_request(100)
    assert events[-1][1] is not None and "hidden size" in events[-1][1].message()
    events = llm_request(576)
    assert all(e is None for _, e in events)
    assert_ok(*chat(mm_front_door, text="Say hi."))


def test_the_same_photo_twice_is_encoded_once(mm_front_door, mm_server):
    """The second request's image comes from the vision stage's encoder cache (omni_encoder_cache_hits_total), and
    both answers are the same."""
    from skimage import data

    from omni_backend.ops.metrics import parse_metrics

    def counters():
        samples = parse_metrics(requests.get(mm_server.metrics_url, timeout=10).text)
        return [sum(v for labels, v in samples.get(name, []) if labels.get("model") == "vision_encoder")
                for name in ("omni_encoder_items_total", "omni_encoder_cache_hits_total")]

    part = image_part(image_bytes("PNG", np.ascontiguousarray(data.coffee()[::-1])))  # no other test sends it
    before = counters()
    answers = [chat_answer(assert_ok(*chat(mm_front_door, part, max_tokens=6))) for _ in range(2)]
    after = counters()
    assert answers[0] == answers[1]
    assert [a - b for a, b in zip(after, before)] == [2, 1]


def test_a_bad_item_fails_only_its_own_request_in_a_dynamic_batch(mm_front_door, mm_server):
    """Two requests reach the vision encoder in one dynamic batch (one execution, two inferences): the one with
    a NaN pixel gets INVALID_ARG naming pixel_values, the other its embeddings, equal to the same item alone."""
    import tritonclient.grpc as grpcclient

    from omni_backend import tensor_names as T

    rng = np.random.default_rng(0)
    good = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
    bad = good.copy()
    bad[0, 1, 7, 9] = np.nan

    def encode(pixels):
        client = grpcclient.InferenceServerClient(mm_server.grpc_url)
        tensor = grpcclient.InferInput(T.PIXEL_VALUES, list(pixels.shape), "FP32")
        tensor.set_data_from_numpy(pixels)
        try:
            return client.infer("vision_encoder", [tensor]).as_numpy(T.EMBEDDINGS)
        except Exception as exc:  # tritonclient's InferenceServerException
            return exc
        finally:
            client.close()

    alone = encode(good * 0.5)  # another item than `good`, so the encoder cache cannot answer for `good` below
    assert isinstance(alone, np.ndarray)
    for _ in range(3):  # two requests sent together batch within the encoder's 50 ms queue delay
        good = good + 1.0  # a new item each try: a cached one would not reach the encoder
        bad = good.copy()
        bad[0, 1, 7, 9] = np.nan
        before = _stats(mm_server, "vision_encoder")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(encode, [good, bad]))
        after = _stats(mm_server, "vision_encoder")
        if after[1] - before[1] == 1:
            break
    assert after[1] - before[1] == 1, "the two requests never met in one batch"
    embeddings, error = answers
    assert isinstance(embeddings, np.ndarray) and embeddings.shape[0] == 1
    assert isinstance(error, Exception) and "pixel_values must be finite" in error.message(), error
    np.testing.assert_array_equal(embeddings, encode(good))  # now from the cache: what the batch gave it
    assert_ok(*chat(mm_front_door, text="Say hi."))
