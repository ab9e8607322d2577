"""`POST /v1/images/generations` over the `text2image` ensemble (serving/image_backend.py).

Fields: `prompt` (required), `n` (1..10; each image is its own Triton request, so the diffusion stage's dynamic
batcher runs them, and concurrent clients' requests, together), `size` ("WIDTHxHEIGHT", one of the sizes the
diffusion model's config allows; default its `default_size`), `response_format` (`b64_json` only: no image is
stored to serve a URL from), and as extensions `seed` (image i of n uses seed + i), `steps`, `guidance_scale`
and `negative_prompt`. `null` means the default for every optional field. The limits are read from the
diffusion model's config on Triton, so the front door and the stage give the same answers; every request
carries the same set of inputs so any two can batch together.
"""

from __future__ import annotations

import asyncio
import base64
from typing import ClassVar, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from omni_backend.serving import errors, protocol
from omni_backend.serving.errors import invalid
from omni_backend.serving.front_door import door_of, require_api_key
from omni_backend.serving.request_body import read_json
from omni_backend.serving.schemas import GENERATION_ERRORS, ImagesResponse, answers, json_body
from omni_backend.stages.diffusion import MAX_SEED, ImageLimits, format_size, parse_size

IMAGE_MODEL_NAMES = ("text2image", "dall-e-2", "dall-e-3", "gpt-image-1")
MAX_N = 10

router = APIRouter(dependencies=[Depends(require_api_key)])


class ImageGenerationRequest(BaseModel):
    """The body of `POST /v1/images/generations`, as `create_images` and the diffusion stage check it (the limits
    the stage's config sets are filled in by `document_limits`). Other fields are ignored."""

    MODEL_NAMES: ClassVar[tuple[str, ...]] = IMAGE_MODEL_NAMES

    model: str = Field(description="text2image, an OpenAI image model name or a served chat model: all draw with "
                                   "the diffusion stage.")
    prompt: str = Field(pattern=r"\S", description="What to draw (not blank).")
    n: int | None = Field(1, ge=1, le=MAX_N, description="Images to make (each its own diffusion request).")
    size: str | None = Field("auto", description="WIDTHxHEIGHT, one of the diffusion stage's sizes; auto: its "
                                                 "default size.")
    response_format: Literal["b64_json"] | None = Field("b64_json", description="No image is stored to serve a "
                                                                                 "URL from.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED - MAX_N, description="Image i of n uses seed + i (an "
                                                                          "extension); null: random.")
    steps: int | None = Field(None, ge=1, description="Denoising steps (an extension); null: the stage's default.")
    guidance_scale: float | None = Field(None, description="Classifier-free guidance (an extension); null: the "
                                                           "stage's default.")
    negative_prompt: str | None = Field(None, description="What not to draw (an extension).")


def document_limits(schema: dict, limits: ImageLimits) -> None:
    """Put the diffusion stage's limits (from its config on Triton) into ImageGenerationRequest's schema."""
    properties = schema["properties"]
    properties["prompt"]["maxLength"] = limits.max_prompt_chars
    properties["size"]["anyOf"][0]["enum"] = ["auto", *limits.size_names]
    properties["steps"]["anyOf"][0]["maximum"] = limits.max_steps
    properties["guidance_scale"]["anyOf"][0].update(minimum=limits.min_guidance, maximum=limits.max_guidance)


IMAGES_ANSWER = {"model": ImagesResponse, "description": "The images, as base64 PNGs."}


@router.post("/v1/images/generations", operation_id="createImage", summary="Image generation",
             openapi_extra=json_body(ImageGenerationRequest), responses=answers(IMAGES_ANSWER, GENERATION_ERRORS))
async def create_images(request: Request):
    """OpenAI's image generation with the diffusion stage (batched with other requests)."""
    door = door_of(request)
    backend = door.images
    body = await read_json(request, door.config.max_body_bytes)
    door.check_model(body, IMAGE_MODEL_NAMES)
    prompt = errors.required_text(body, "prompt")
    limits = await backend.limits()
    size = body.get("size")
    if size is None or size == "auto":
        width, height = limits.default_pair
    else:
        allowed = ", ".join(limits.size_names)
        try:
            width, height = parse_size(size if isinstance(size, str) else "")
        except ValueError:
            raise invalid(f"size {size!r} is not valid; supported sizes: {allowed}", "size") from None
        if (width, height) not in limits.size_pairs:
            raise invalid(f"size {format_size((width, height))} is not supported; supported sizes: {allowed}",
                          "size")
    n = errors.number(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise invalid(f"n must be between 1 and {MAX_N}, got {n}", "n")
    if body.get("response_format") not in (None, "b64_json"):
        raise invalid("response_format: only 'b64_json' is supported (no image is stored to serve a URL)",
                      "response_format")
    steps = errors.number(body, "steps", int, limits.default_steps)
    guidance = errors.number(body, "guidance_scale", float, limits.default_guidance)
    seed = errors.number(body, "seed", int, None)
    if seed is not None and not 0 <= seed <= MAX_SEED - MAX_N:
        raise invalid(f"seed must be between 0 and {MAX_SEED - MAX_N}", "seed")
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


