"""The encoder cache (omni_backend/stages/encoder_cache.py): an image or clip seen recently skips the encoder, items
repeated in one batch are encoded once, the cache stays within its bytes, and the metrics count the hits."""

from __future__ import annotations

import numpy as np
import torch

from omni_backend.ops.metrics import EncoderMetrics
from omni_backend.stages.encoder_cache import EncoderCache, content_key
from omni_backend.stages.media_encoder import EncoderStage


class _CountingEncoder(torch.nn.Module):
    """Embeddings [b, 2, 3] = each item's mean and max, times a weight; records the batch of every forward."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
        self.batches: list[int] = []

    def forward(self, x, lengths=None):
        self.batches.append(x.shape[0])
        flat = x.flatten(1)
        return torch.stack([flat.mean(1), flat.amax(1)], dim=1)[:, :, None] * self.weight


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((1, 3, 8, 8), dtype=np.float32)


def test_two_requests_with_the_same_image_run_the_encoder_once():
    model = _CountingEncoder()
    stage = EncoderStage(model)
    (first,) = stage.run([_image(0)])
    (second,) = stage.run([_image(0).copy()])
    assert model.batches == [1]
    np.testing.assert_array_equal(first, second)
    (other,) = stage.run([_image(1)])
    assert model.batches == [1, 1] and not np.array_equal(other, first)
    assert (stage.num_items, stage.num_encoded) == (3, 2)


def test_a_batch_encodes_each_distinct_new_item_once_and_keeps_the_request_order():
    model = _CountingEncoder()
    stage = EncoderStage(model)
    stage.run([_image(0)])
    a, b = _image(1), _image(2)
    outputs = stage.run([np.concatenate([a, _image(0)]), b, a.copy()])
    assert model.batches == [1, 2]  # image 0 from the cache, image 1 once though sent twice, image 2
    assert [o.shape for o in outputs] == [(2, 2, 3), (1, 2, 3), (1, 2, 3)]
    expected = {seed: model(torch.from_numpy(_image(seed))).detach().numpy()[0] for seed in (0, 1, 2)}
    np.testing.assert_array_equal(outputs[0][0], expected[1])
    np.testing.assert_array_equal(outputs[0][1], expected[0])
    np.testing.assert_array_equal(outputs[1][0], expected[2])
    np.testing.assert_array_equal(outputs[2][0], expected[1])
    assert (stage.num_items, stage.num_encoded) == (5, 3)


def test_the_cache_keys_by_dtype_shape_and_values_and_evicts_the_least_recently_used():
    item = np.zeros((2, 3), dtype=np.float32)
    keys = {content_key(item), content_key(item.astype(np.float64)), content_key(item.reshape(3, 2)),
            content_key(item + 1e-7)}
    assert len(keys) == 4 and content_key(item.copy()) == content_key(item)
    value = np.zeros(256, dtype=np.float32)  # 1 KiB
    cache = EncoderCache(capacity_bytes=3 * 1024)
    for name in (b"a", b"b", b"c"):
        cache.put(name, value)
    assert cache.get(b"a") is not None  # a is now the most recently used
    cache.put(b"d", value)
    assert len(cache) == 3 and cache.get(b"b") is None and cache.get(b"a") is not None
    cache.put(b"huge", np.zeros(1024, dtype=np.float32))  # 4 KiB, above the capacity: not stored
    assert cache.get(b"huge") is None and len(cache) == 3


class _Metric:
    def __init__(self):
        self.value = 0

    def increment(self, value):
        self.value += value


class _Family:
    COUNTER = "counter"

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels):  # noqa: N802 - pb_utils' spelling
        return _Metric()


class _PbUtils:
    MetricFamily = _Family


def test_the_metrics_count_items_and_hits():
    metrics = EncoderMetrics(_PbUtils, "vision_encoder", "1")
    metrics.publish(num_items=1, num_encoded=1)
    metrics.publish(num_items=3, num_encoded=2)
    assert (metrics.items.value, metrics.hits.value) == (3, 1)


class _ThreeChannelEncoder(_CountingEncoder):
    """Refuses items that are not 3 channels, as a real vision tower's first convolution does."""

    def forward(self, x, lengths=None):
        if x.shape[1] != 3:
            raise RuntimeError(f"expected 3 channels, got {x.shape[1]}")
        return super().forward(x, lengths)


def test_a_bad_item_in_a_dynamic_batch_fails_only_its_own_request():
    """Per request of one batch: a NaN item and an item of a shape the encoder cannot read each fail their own
    request; the good one gets the embeddings it gets alone."""
    from omni_backend import tensor_names as T

    stage = EncoderStage(_ThreeChannelEncoder())
    good, nan, four_channels = _image(3), _image(4), np.zeros((1, 4, 8, 8), dtype=np.float32)
    nan[0, 0, 1, 2] = np.nan
    results = stage.run_batch([{T.PIXEL_VALUES: nan}, {T.PIXEL_VALUES: good}, {T.PIXEL_VALUES: four_channels}])
    assert isinstance(results[0], ValueError) and "pixel_values must be finite" in str(results[0])
    assert isinstance(results[2], RuntimeError) and "expected 3 channels" in str(results[2])
    alone = EncoderStage(_ThreeChannelEncoder()).run([good])[0]
    np.testing.assert_array_equal(results[1][T.EMBEDDINGS], alone)
