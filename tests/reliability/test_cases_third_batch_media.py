"""The media cases of the third batch of ../shared/cases/README.md (c31-c33, issue 25) as tests against the real
stack: the session's tritonserver with every model and its front door. After each test a normal greedy chat
request must still give its exact answer (`followed_by_a_normal_request`, tests/conftest.py).

The default model reads images through SmolVLM's processor and the `vision_encoder` stage, whose encoder cache keys
each item by its exact pixel values (omni_backend/stages/encoder_cache.py): a cache hit for the second of two
pictures means the encoder got bit-identical input, hence the same embeddings, and a miss means the model saw a
different picture. The random default encoders make answers a weak witness; the cache is an exact one.

case -> test
  c31  test_c31_transparent_pixels_are_seen_on_white
  c32  test_c32_exif_orientation_is_applied_before_resizing
  c33  test_c33_non_finite_audio_is_400_naming_the_part
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import requests
from helpers.media_inputs import assert_400, assert_ok, audio_bytes, audio_part, chat, chat_answer, image_bytes, image_part

from omni_backend.ops.metrics import parse_metrics

pytestmark = pytest.mark.usefixtures("followed_by_a_normal_request")


def encoder_counters(server) -> tuple[float, float]:
    """(items encoded or found, cache hits) of the vision_encoder stage so far."""
    samples = parse_metrics(requests.get(server.metrics_url, timeout=10).text)
    return tuple(sum(v for labels, v in samples.get(name, []) if labels.get("model") == "vision_encoder")
                 for name in ("omni_encoder_items_total", "omni_encoder_cache_hits_total"))


def seen(front_door, server, part: dict) -> tuple[tuple[str, int], bool]:
    """Chat about one picture: ((greedy answer, prompt tokens), whether the vision encoder's cache held it)."""
    before = encoder_counters(server)
    answer = chat_answer(assert_ok(*chat(front_door.url, part, max_tokens=6)))
    items, hits = (a - b for a, b in zip(encoder_counters(server), before))
    assert items == 1, items
    return answer, hits == 1


def test_c31_transparent_pixels_are_seen_on_white(front_door, triton_server):
    """An RGBA PNG whose transparent region stores black is the picture flattened on white, not on black."""
    from skimage import data

    picture = np.ascontiguousarray(data.coffee()[100:300, 150:450])  # no other test sends this crop
    hidden = np.zeros(picture.shape[:2], dtype=bool)
    hidden[40:160, 60:240] = True
    rgba = np.dstack([picture, np.where(hidden, 0, 255).astype(np.uint8)])
    rgba[hidden, :3] = 0
    on_white, on_black = picture.copy(), picture.copy()
    on_white[hidden], on_black[hidden] = 255, 0

    white_answer, cached = seen(front_door, triton_server, image_part(image_bytes("PNG", on_white)))
    assert not cached
    rgba_answer, cached = seen(front_door, triton_server, image_part(image_bytes("PNG", rgba)))
    assert cached and rgba_answer == white_answer
    _, cached = seen(front_door, triton_server, image_part(image_bytes("PNG", on_black)))
    assert not cached  # a different picture misses: the check can fail


def test_c32_exif_orientation_is_applied_before_resizing(front_door, triton_server):
    """A JPEG tagged Orientation=6 is the picture a viewer shows: its stored pixels turned clockwise."""
    from PIL import Image
    from skimage import data

    stored = np.ascontiguousarray(data.astronaut()[40:340, 60:460])  # 300x400, sideways as the sensor saw it

    def jpeg(exif=None) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(stored).save(buffer, "JPEG", quality=90, **({"exif": exif} if exif else {}))
        return buffer.getvalue()

    orientation = Image.Exif()
    orientation[0x0112] = 6
    tagged, untagged = jpeg(orientation), jpeg()
    sideways = np.asarray(Image.open(io.BytesIO(untagged)).convert("RGB"))  # the same DCT data as `tagged`
    upright = np.ascontiguousarray(np.rot90(sideways, k=-1))

    upright_answer, cached = seen(front_door, triton_server, image_part(image_bytes("PNG", upright)))
    assert not cached
    tagged_answer, cached = seen(front_door, triton_server, image_part(tagged, "image/jpeg"))
    assert cached and tagged_answer == upright_answer
    _, cached = seen(front_door, triton_server, image_part(untagged, "image/jpeg"))
    assert not cached  # the stored, sideways pixels are another picture


def test_c33_non_finite_audio_is_400_naming_the_part(front_door, triton_server):
    """A float WAV with one NaN and one +Inf sample is refused before any feature is made, by the front door and
    by the omni_chat_mm ensemble; the same clip without them is answered."""
    from helpers.chat_client import stream_infer

    clip = (0.3 * np.sin(np.arange(16000) * 2 * np.pi * 440 / 16000)).astype(np.float32)
    bad = clip.copy()
    bad[4000], bad[8000] = np.nan, np.inf
    part = audio_part(audio_bytes("WAV", bad, 16000, "FLOAT"))
    status, body = chat(front_door.url, {"type": "text", "text": "Listen."}, part, text="What was said?")
    assert_400(status, body, "messages[0].content[2]", "non-finite samples")

    messages = [{"role": "user", "content": [{"type": "text", "text": "What was said?"}, part]}]
    result = stream_infer(triton_server.grpc_url, {"text_input": json.dumps(messages), "max_tokens": 4,
                                                   "temperature": 0.0}, model="omni_chat_mm")
    assert result.error is not None and "text_input[0].content[1]" in result.error, result.error
    assert "non-finite samples" in result.error, result.error

    assert_ok(*chat(front_door.url, audio_part(audio_bytes("WAV", clip, 16000, "FLOAT")), text="What was said?"))
