"""Image generation out of the front door: `POST /v1/images/generations` over the `text2image` ensemble
(diffusion with dynamic batching -> png_encode; omni_backend/stages/diffusion.py).

Fields: `prompt` (required), `n` (1..10; each image is its own Triton request, so the diffusion stage's dynamic
batcher runs them, and concurrent clients' requests, together), `size` ("WIDTHxHEIGHT", one of the sizes the
diffusion model's config allows; default its `default_size`), `response_format` (`b64_json` only: no image is
stored to serve a URL from), and as extensions `seed` (image i of n uses seed + i), `steps`, `guidance_scale`
and `negative_prompt`. The limits are read from the diffusion model's config on Triton, so the front door and
the stage give the same answers; every request carries the same set of inputs so any two can batch together.
"""

from __future__ import annotations

import asyncio
import base64
import math

import numpy as np
import tritonclient.grpc as grpcclient
from fastapi import APIRouter, Request
from tritonclient.utils import InferenceServerException

from omni_backend.serving import errors, protocol
from omni_backend.serving.errors import invalid
from omni_backend.serving.pipeline import TritonGrpcUser, infer_to_completion, numeric_array
from omni_backend.stages.diffusion import ImageLimits, format_size, parse_size

ENSEMBLE = "text2image"
STAGE = "diffusion"
IMAGE_MODEL_NAMES = (ENSEMBLE, "dall-e-2", "dall-e-3", "gpt-image-1")
MAX_N = 10
_STAGE_FIELDS = {"prompt": "prompt", "negative_prompt": "negative_prompt", "size": "size", "steps": "steps",
                 "guidance_scale": "guidance_scale", "seed": "seed"}


class ImageBackend(TritonGrpcUser):
    """The text2image ensemble over gRPC, with the diffusion stage's limits read from its config."""

    def __init__(self, grpc_url: str):
        super().__init__(grpc_url)
        self._limits: ImageLimits | None = None

    async def limits(self) -> ImageLimits:
        if self._limits is None:
            try:
                config = (await self.client.get_model_config(STAGE, as_json=True))["config"]
            except InferenceServerException as exc:
                raise errors.unavailable(f"image generation is not available: {exc.message()}") from None
            parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
            self._limits = ImageLimits.from_parameters(parameters)
        return self._limits

    async def generate(self, values: dict) -> tuple[bytes, int]:
        """One image: (PNG bytes, seed used).

        Raises:
            OpenAIError: 400 naming the field for the stage's INVALID_ARG, 503/500 otherwise.
        """
        inputs = []
        for name, datatype, value in (
            ("prompt", "BYTES", values["prompt"].encode("utf-8")), ("width", "INT32", values["width"]),
            ("height", "INT32", values["height"]), ("steps", "INT32", values["steps"]),
            ("guidance_scale", "FP32", values["guidance_scale"]), ("seed", "INT64", values["seed"]),
        ) + ((("negative_prompt", "BYTES", values["negative_prompt"].encode("utf-8")),)
             if values.get("negative_prompt") is not None else ()):
            if datatype == "BYTES":
                array = np.array([[value]], dtype=np.object_)
            else:  # a value beyond the tensor's type is a 400 (numpy would wrap a seed or steps into range)
                array = numeric_array([value], datatype, _STAGE_FIELDS.get(name, name)).reshape(1, 1)
            tensor = grpcclient.InferInput(name, [1, 1], datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        try:
            result = await infer_to_completion(self.client, ENSEMBLE, inputs)  # never cancelled: see there
        except InferenceServerException as exc:
            raise _image_error(exc.status(), exc.message()) from None
        return bytes(result.as_numpy("png").reshape(-1)[0]), int(result.as_numpy("used_seed").reshape(-1)[0])


def _image_error(status: str | None, message: str):
    message = message.removeprefix(f"in ensemble '{ENSEMBLE}', ")
    name = (status or "").rsplit(".", 1)[-1]
    if name == "INVALID_ARGUMENT":
        first = message.split(" ")[0]
        return invalid(message, _STAGE_FIELDS.get(first))
    return errors.grpc_status_error(status, message, "prompt")


def _number(body: dict, name: str, kind: type, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise invalid(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    if kind is float and not math.isfinite(value):
        raise invalid(f"{name} must be a finite number", name)
    return kind(value)


def register(router: APIRouter, door) -> None:
    """Add `POST /v1/images/generations` to the front door's /v1 router (`door`: app.FrontDoor)."""
    backend = ImageBackend(door.config.triton_grpc)
    door.images = backend

    @router.post("/v1/images/generations")
    async def create_images(request: Request):
        from omni_backend.serving.app import read_json

        body = await read_json(request, door.config.max_body_bytes)
        door.check_model(body, IMAGE_MODEL_NAMES)
        prompt = errors.required_text(body, "prompt")
        limits = await backend.limits()
        size = body.get("size")
        if size is None or size == "auto":
            width, height = limits.default_size
        else:
            allowed = ", ".join(limits.size_names)
            try:
                width, height = parse_size(size if isinstance(size, str) else "")
            except ValueError:
                raise invalid(f"size {size!r} is not valid; supported sizes: {allowed}", "size") from None
            if (width, height) not in limits.sizes:
                raise invalid(f"size {format_size((width, height))} is not supported; supported sizes: {allowed}",
                              "size")
        n = _number(body, "n", int, 1)
        if not 1 <= n <= MAX_N:
            raise invalid(f"n must be between 1 and {MAX_N}, got {n}", "n")
        if body.get("response_format", "b64_json") != "b64_json":
            raise invalid("response_format: only 'b64_json' is supported (no image is stored to serve a URL)",
                          "response_format")
        steps = _number(body, "steps", int, limits.default_steps)
        guidance = _number(body, "guidance_scale", float, limits.default_guidance)
        seed = _number(body, "seed", int, None)
        if seed is not None and not 0 <= seed <= protocol.MAX_SEED - MAX_N:
            raise invalid(f"seed must be between 0 and {protocol.MAX_SEED - MAX_N}", "seed")
        negative = body.get("negative_prompt")
        if negative is not None and not isinstance(negative, str):
            raise invalid("negative_prompt must be a string", "negative_prompt")

        values = [{"prompt": prompt, "width": width, "height": height, "steps": steps, "guidance_scale": guidance,
                   "seed": -1 if seed is None else seed + i, "negative_prompt": negative} for i in range(n)]
        async with door.admitted():
            results = await asyncio.gather(*(backend.generate(v) for v in values), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return {"created": protocol.now(),
                "data": [{"b64_json": base64.b64encode(png).decode("ascii"), "revised_prompt": None, "seed": used}
                         for png, used in results]}


__all__ = ["ImageBackend", "register"]
