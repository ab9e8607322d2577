"""The diffusion stage's pieces without a server: limits, request checks, grouping into pipeline calls, PNG."""

import io

import numpy as np
import pytest

from omni_backend.stages.diffusion import DiffusionStage, ImageLimits, ImageRequest, encode_png, parse_size


def arrays(**values):
    kinds = {"prompt": object, "negative_prompt": object, "width": np.int32, "height": np.int32,
             "steps": np.int32, "guidance_scale": np.float32, "seed": np.int64}
    return {name: np.array([[v.encode() if isinstance(v, str) else v]], dtype=kinds[name])
            for name, v in values.items()}


def test_limits_from_config_parameters():
    limits = ImageLimits.from_strings({"sizes": "64x64, 128x96", "default_size": "128x96", "max_steps": "8",
                                       "default_steps": "4", "max_guidance": "10"})
    assert limits.size_pairs == ((64, 64), (128, 96)) and limits.default_pair == (128, 96)
    assert (limits.max_steps, limits.default_steps, limits.max_guidance) == (8, 4, 10.0)
    with pytest.raises(ValueError, match="default_size 256x256 is not in sizes"):
        ImageLimits.from_strings({"sizes": "64x64", "default_size": "256x256"})
    with pytest.raises(ValueError, match="setting sizes must be WIDTHxHEIGHT"):
        ImageLimits.from_strings({"sizes": "big"})
    with pytest.raises(ValueError, match="size must look like WIDTHxHEIGHT"):
        parse_size("big")


def test_requests_are_checked_against_the_limits():
    limits = ImageLimits()
    request = ImageRequest.from_arrays(arrays(prompt="a red bicycle", seed=5), limits)
    assert (request.width, request.height, request.steps, request.seed) == (128, 128, 10, 5)
    assert ImageRequest.from_arrays(arrays(prompt="x"), limits).seed >= 0  # drawn when absent
    for values, fragment in [
        (dict(prompt=" "), "prompt must not be empty"),
        (dict(prompt="x", width=100000, height=10000), "size 100000x10000 is not supported; supported sizes: "
                                                       "64x64, 128x128, 256x256"),
        (dict(prompt="x", steps=0), "steps must be between 1 and 50"),
        (dict(prompt="x", steps=51), "steps must be between 1 and 50"),
        (dict(prompt="x", guidance_scale=float("nan")), "guidance_scale must be between"),
        (dict(prompt="x" * 1001), "prompt is 1001 characters"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            ImageRequest.from_arrays(arrays(**values), limits)


class FakePipeline:
    """Records each call; the image's pixels encode the seed's first draw so determinism is visible."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompt, negative_prompt, height, width, num_inference_steps, guidance_scale, generator,
                 output_type):
        import torch

        self.calls.append((len(prompt), width, height, num_inference_steps, guidance_scale))

        class Result:
            images = np.stack([torch.rand(height, width, 3, generator=g).numpy() for g in generator])

        return Result()


def test_compatible_requests_share_one_pipeline_call_and_seeds_decide_the_pixels():
    pipeline = FakePipeline()
    stage = DiffusionStage(pipeline, ImageLimits())
    limits = ImageLimits()
    requests = [ImageRequest.from_arrays(arrays(prompt=f"p{i}", seed=i, width=64, height=64, steps=2), limits)
                for i in range(3)]
    requests.append(ImageRequest.from_arrays(arrays(prompt="other", seed=0, width=128, height=128, steps=2), limits))
    images = stage.generate(requests)
    assert sorted(pipeline.calls) == [(1, 128, 128, 2, 7.5), (3, 64, 64, 2, 7.5)]
    assert [im.shape for im in images] == [(64, 64, 3)] * 3 + [(128, 128, 3)]
    assert all(im.dtype == np.uint8 for im in images)
    again = stage.generate(requests[:1])
    assert np.array_equal(again[0], images[0]) and not np.array_equal(images[0], images[1])


def test_png_encoding_is_lossless_and_repeatable():
    from PIL import Image

    image = np.random.default_rng(0).integers(0, 256, size=(32, 48, 3), dtype=np.uint8)
    data = encode_png(image)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and encode_png(image) == data
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), image)
    with pytest.raises(ValueError, match="image must be uint8"):
        encode_png(image.astype(np.float32))
