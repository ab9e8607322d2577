"""Diffusion stage: text -> image with a diffusers pipeline, batching compatible requests into one run.

The `diffusion` Triton model has dynamic batching: Triton hands `execute` the requests that arrived together.
Requests are compatible when they share size, step count and guidance scale (one pipeline call runs one
denoising schedule at one resolution); each compatible group is one pipeline call with a list of prompts and
one seeded `torch.Generator` per request, so a request's starting noise depends only on its own seed.

A seed gives a deterministic image: the same request alone (or in the same batch) gives byte-identical
pixels on the same machine and build. Batched with other requests the float results can differ in the last
bits (different matrix shapes), which may move a pixel by one level.

Input tensors (each shape [1], with Triton's batch dimension in front):

    prompt          STRING  required, non-blank, at most `max_prompt_chars` characters
    negative_prompt STRING  optional
    width, height   INT32   optional (default `default_size`); the pair must be one of `sizes`
    steps           INT32   optional, 1..max_steps (default `default_steps`)
    guidance_scale  FP32    optional, min_guidance..max_guidance (default `default_guidance`)
    seed            INT64   optional; absent or negative: a random seed (returned, so the image can be remade)

Output tensors: `image` UINT8 [height, width, 3] (RGB) and `seed` INT64 [1] (the seed used).
Send the same set of optional inputs in requests that should batch together: Triton batches requests whose
inputs match in name and shape.
"""

from __future__ import annotations

import math
import secrets
import threading
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from omni_backend import tensor_names as T
from omni_backend.engine.config import DEVICE_PATTERN, DTYPES
from omni_backend.settings import SettingGroup, setting
from omni_backend.stages.tensors import one_value
from omni_backend.vocabulary import FieldError

INPUT_NAMES = (T.PROMPT, T.NEGATIVE_PROMPT, T.WIDTH, T.HEIGHT, T.STEPS, T.GUIDANCE_SCALE, T.SEED)
MAX_SEED = 2**63 - 1


@dataclass
class DiffusionSettings(SettingGroup):
    """Settings of the diffusion stage (rendered as `diffusion_<field>`, omni_backend/repository.py)."""

    model_path: str = setting("", "the diffusion stage's pipeline folder (diffusers layout); empty: the tiny random "
                              "one setup builds (.cache/models/tiny-sd-random)")
    device: str = setting("auto", "auto (CUDA when torch can use it, else cpu), cpu, cuda or cuda:N",
                          pattern=DEVICE_PATTERN, forms="auto, cpu, cuda or cuda:N")
    dtype: str = setting("auto", "auto: float16 on CUDA, float32 on CPU", choices=DTYPES)
    gpu_memory_fraction: float = setting(0.08, "share of the GPU for the diffusion stage (ops/gpu_budget.py)",
                                         low=0.0, low_open=True, high=1.0)

    PREFIX = "diffusion_"  # the settings' names: diffusion_<field>


SIZES_PATTERN = r"\s*\d+x\d+\s*(,\s*\d+x\d+\s*)*"


@dataclass(frozen=True)
class ImageLimits(SettingGroup):
    """What requests may ask for: diffusion settings (constants of its model config, parsed by `from_strings`;
    the front door reads the same config for its 400s)."""

    sizes: str = setting("64x64,128x128,256x256", "the sizes a request may ask for, WIDTHxHEIGHT, comma-separated",
                         pattern=SIZES_PATTERN, forms="WIDTHxHEIGHT[,WIDTHxHEIGHT...]")
    default_size: str = setting("128x128", "the size of a request that names none (one of sizes)",
                                pattern=SIZES_PATTERN, forms="WIDTHxHEIGHT")
    max_steps: int = setting(50, "most denoising steps a request may ask for", low=1)
    default_steps: int = setting(10, "denoising steps of a request that names none", low=1)
    min_guidance: float = setting(0.0, "lowest guidance scale a request may ask for", low=0.0)
    max_guidance: float = setting(20.0, "highest guidance scale a request may ask for", low=0.0)
    default_guidance: float = setting(7.5, "guidance scale of a request that names none", low=0.0)
    max_prompt_chars: int = setting(1000, "longest prompt, characters", low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.default_pair not in self.size_pairs:
            raise ValueError(f"diffusion parameters: default_size {self.default_size} is not in sizes")
        if not 1 <= self.default_steps <= self.max_steps:
            raise ValueError("diffusion parameters: default_steps must be within 1..max_steps")
        if not self.min_guidance <= self.default_guidance <= self.max_guidance:
            raise ValueError("diffusion parameters: default_guidance must be within min_guidance..max_guidance")

    @property
    def size_pairs(self) -> tuple[tuple[int, int], ...]:
        """`sizes` as (width, height) pairs."""
        return tuple(parse_size(size) for size in self.sizes.split(","))

    @property
    def default_pair(self) -> tuple[int, int]:
        return parse_size(self.default_size)

    @property
    def size_names(self) -> list[str]:
        return [format_size(size) for size in self.size_pairs]


def parse_size(text: str) -> tuple[int, int]:
    """"WIDTHxHEIGHT" -> (width, height).

    Raises:
        ValueError: not two positive integers joined by "x".
    """
    parts = text.strip().lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or not all(int(p) > 0 for p in parts):
        raise ValueError(f"size must look like WIDTHxHEIGHT (e.g. 256x256), got {text!r}")
    return int(parts[0]), int(parts[1])


def format_size(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


@dataclass(frozen=True)
class ImageRequest:
    """One validated request."""

    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int

    @property
    def group(self) -> tuple:
        """Requests with the same group run in one pipeline call."""
        return self.width, self.height, self.steps, self.guidance_scale

    @classmethod
    def from_arrays(cls, arrays: dict, limits: ImageLimits) -> "ImageRequest":
        """Validate one request's tensors (batch dimension included or not) against `limits`.

        Raises:
            FieldError: naming the tensor (`size` for the width and height together) and what is allowed.
        """
        prompt = one_value(arrays, T.PROMPT, str)
        if prompt is None or not prompt.strip():
            raise FieldError(T.PROMPT, "must not be empty")
        if len(prompt) > limits.max_prompt_chars:
            raise FieldError(T.PROMPT, f"is {len(prompt)} characters; the limit is {limits.max_prompt_chars}")
        negative = one_value(arrays, T.NEGATIVE_PROMPT, str)
        width = one_value(arrays, T.WIDTH, int, limits.default_pair[0])
        height = one_value(arrays, T.HEIGHT, int, limits.default_pair[1])
        if (width, height) not in limits.size_pairs:
            raise FieldError("size", f"{width}x{height} is not supported; supported sizes: "
                             f"{', '.join(limits.size_names)}")
        steps = one_value(arrays, T.STEPS, int, limits.default_steps)
        if not 1 <= steps <= limits.max_steps:
            raise FieldError(T.STEPS, f"must be between 1 and {limits.max_steps}, got {steps}")
        guidance = one_value(arrays, T.GUIDANCE_SCALE, float, limits.default_guidance)
        if not (math.isfinite(guidance) and limits.min_guidance <= guidance <= limits.max_guidance):
            raise FieldError(T.GUIDANCE_SCALE, f"must be between {limits.min_guidance} and {limits.max_guidance}, "
                             f"got {guidance}")
        seed = one_value(arrays, T.SEED, int, -1)
        if seed < 0:
            seed = secrets.randbelow(MAX_SEED)
        return cls(prompt, negative or None, width, height, steps, float(guidance), seed)


class DiffusionStage:
    """Runs a diffusers text-to-image pipeline on groups of compatible requests.

    Args:
        pipeline: a diffusers pipeline called as `pipeline(prompt=[...], negative_prompt=..., height=, width=,
            num_inference_steps=, guidance_scale=, generator=[...], output_type="np")`.
        limits: request limits.
        device: torch device the pipeline runs on (generators are made there).
    """

    input_names = INPUT_NAMES  # the model's inputs (triton_glue.StageModel)

    def __init__(self, pipeline, limits: ImageLimits, device: str = "cpu"):
        self.pipeline = pipeline
        self.limits = limits
        self.device = device
        self.pipeline_calls = 0
        self._lock = threading.Lock()

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> "DiffusionStage":
        """From the diffusion model's string parameters: `DiffusionSettings`' and `ImageLimits`'.

        Raises:
            ValueError: a malformed setting; RuntimeError: a CUDA device torch cannot use.
        """
        own = DiffusionSettings.from_strings(parameters)
        return cls.from_pretrained(own.model_path, ImageLimits.from_strings(parameters), own.device, own.dtype,
                                   own.gpu_memory_fraction)

    @classmethod
    def from_pretrained(cls, path: str, limits: ImageLimits, device: str, dtype: str,
                        gpu_memory_fraction: float) -> "DiffusionStage":
        """Load a local diffusers pipeline folder (offline). `auto`: CUDA in float16 when available, else CPU
        in float32. On a GPU the process is capped at `gpu_memory_fraction` of its memory (ops/gpu_budget.py).

        Raises:
            ValueError: a malformed device or fraction; RuntimeError: a CUDA device torch cannot use.
        """
        import torch
        from diffusers import DiffusionPipeline

        from omni_backend.ops.gpu_budget import apply_gpu_memory_budget
        from omni_backend.ops.hardware import resolve_device

        device = resolve_device(device)
        apply_gpu_memory_budget(device, gpu_memory_fraction, "diffusion")
        if dtype == "auto":
            dtype = "float16" if device.startswith("cuda") else "float32"
        pipeline = DiffusionPipeline.from_pretrained(path, local_files_only=True, torch_dtype=getattr(torch, dtype))
        pipeline.to(device)
        pipeline.set_progress_bar_config(disable=True)
        return cls(pipeline, limits, device)

    def run_batch(self, requests: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray] | Exception]:
        """A dynamic batch: each request's input arrays (`INPUT_NAMES`) -> its `image` and `seed`, or the error of
        that request alone (`ImageRequest.from_arrays`); the valid ones are generated together (`generate`), and
        a failure there fails those."""
        results: list = [None] * len(requests)
        valid: dict[int, ImageRequest] = {}
        for index, arrays in enumerate(requests):
            try:
                valid[index] = ImageRequest.from_arrays(arrays, self.limits)
            except ValueError as exc:
                results[index] = exc
        if valid:
            try:
                images = self.generate(list(valid.values()))
            except Exception as exc:
                images = [exc] * len(valid)
            for (index, item), image in zip(valid.items(), images):
                results[index] = image if isinstance(image, Exception) else \
                    {T.IMAGE: image[np.newaxis], T.SEED: np.array([[item.seed]], dtype=np.int64)}
        return results

    def generate(self, requests: list[ImageRequest]) -> list[np.ndarray]:
        """Images (uint8 [height, width, 3]) for `requests`, in order; one pipeline call per compatible group."""
        import torch

        groups: dict[tuple, list[int]] = defaultdict(list)
        for index, request in enumerate(requests):
            groups[request.group].append(index)
        images: list[np.ndarray | None] = [None] * len(requests)
        for (width, height, steps, guidance), members in groups.items():
            batch = [requests[i] for i in members]
            negative = [r.negative_prompt or "" for r in batch] if any(r.negative_prompt for r in batch) else None
            generators = [torch.Generator(device=self.device).manual_seed(r.seed) for r in batch]
            with self._lock, torch.inference_mode():
                self.pipeline_calls += 1
                result = self.pipeline(
                    prompt=[r.prompt for r in batch], negative_prompt=negative, height=height, width=width,
                    num_inference_steps=steps, guidance_scale=guidance, generator=generators, output_type="np",
                )
            for i, pixels in zip(members, result.images):
                images[i] = to_uint8(pixels)
        return images


def to_uint8(pixels: np.ndarray) -> np.ndarray:
    """Float RGB in [0, 1] (diffusers' "np" output) -> uint8, rounded."""
    return np.clip(np.rint(np.asarray(pixels, dtype=np.float32) * 255.0), 0, 255).astype(np.uint8)


def encode_png(image: np.ndarray) -> bytes:
    """uint8 [height, width, 3] -> PNG file bytes (deterministic for the same pixels)."""
    import io

    from PIL import Image

    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] not in (1, 3, 4):
        raise ValueError(f"image must be uint8 [height, width, 1|3|4], got {image.dtype} {list(image.shape)}")
    buffer = io.BytesIO()
    Image.fromarray(image if image.shape[2] != 1 else image[:, :, 0]).save(buffer, format="PNG")
    return buffer.getvalue()


def png_outputs(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """png_encode's answer: each image of `image` uint8 [n, height, width, 3] -> `png` BYTES [n, 1].

    Raises:
        FieldError: `image` missing or not uint8 [n, height, width, 1|3|4].
    """
    images = arrays.get(T.IMAGE)
    if images is None or images.ndim != 4:
        raise FieldError(T.IMAGE, "must be uint8 [n, height, width, 1|3|4]")
    try:
        return {T.PNG: np.array([[encode_png(image)] for image in images], dtype=np.object_)}
    except ValueError as exc:
        raise FieldError(T.IMAGE, str(exc)) from None
