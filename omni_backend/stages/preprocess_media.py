"""The media side of the preprocess stage: which encoders it prepares inputs for, and the media output tensors it
sends beside the prompt (described in preprocess.py's module docstring)."""

from __future__ import annotations

import json

import numpy as np

from omni_backend import tensor_names as T
from omni_backend.settings import parse_field
from omni_backend.stages.tensors import string_tensor

MEDIA_OUTPUT_NAMES = (T.PIXEL_VALUES, T.INPUT_FEATURES, T.MEDIA_PARTS, T.MEDIA_POSITIONS, T.PROMPT_POSITIONS)
ENCODER_INPUTS = {"image": T.PIXEL_VALUES, "audio": T.INPUT_FEATURES}  # the media output holding each kind's items


class MediaConfig:
    """The encoders the preprocess stage prepares inputs for, and the media limits.

    Args:
        specs: kind ("image"/"audio") -> `MediaSpec` of its project encoder; a kind without one answers 400.
        limits: `omni_backend.stages.media.MediaLimits`.
        prompt: the `hf_prompt.ProcessorPrompt` of a multimodal LLM checkpoint (the class its model registry row
            names), which then renders every chat and reads its own kind of media; `specs` then holds the project
            encoders of the other kinds, if any.
    """

    def __init__(self, specs: dict, limits, prompt=None):
        self.specs, self.limits, self.prompt = specs, limits, prompt

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> "MediaConfig":
        """From preprocess config parameters: `llm_model_path` (a multimodal checkpoint brings its own encoder
        and processor), `vision_model_path` / `audio_model_path` (empty: the default encoders; "none": off) and
        the `MediaLimits` fields.

        Raises:
            ValueError: an unsupported checkpoint architecture (`omni_backend.checkpoints`).
        """
        from omni_backend.stages.media import MediaLimits
        from omni_backend.stages.media_spec import SPEC_FILE, MediaSpec, media_source

        from omni_backend.engine.config import EngineConfig

        limits = MediaLimits.from_strings(parameters)
        llm_model_path = parse_field(EngineConfig, "model_path", parameters.get("llm_model_path"), "llm_model_path")
        specs, prompt = {}, None
        for kind, key in (("image", "vision_model_path"), ("audio", "audio_model_path")):
            configured = parameters.get(key, "")
            source = media_source(kind, "" if configured.lower() == "none" else configured, llm_model_path)
            if source is not None and source.architecture is not None:
                from omni_backend.engine.models import registry

                prompt = registry.load(source.architecture.processor)(source.folder, source.architecture)
            elif source is not None and configured.lower() != "none" and (source.folder / SPEC_FILE).is_file():
                specs[kind] = MediaSpec.load(source.folder)
        return cls(specs, limits, prompt)


def empty_media_outputs(specs: dict) -> dict[str, np.ndarray]:
    """Media outputs of a request without media (zero items, zero placeholders, no M-RoPE ids: [3, 0])."""
    image = specs["image"].processor["image_size"] if "image" in specs else 224
    audio = specs["audio"].processor if "audio" in specs else {"feature_size": 80, "max_frames": 3000}
    return {
        T.MEDIA_PARTS: string_tensor("[]"),
        T.MEDIA_POSITIONS: np.zeros(0, dtype=np.int32),
        T.PROMPT_POSITIONS: np.zeros((3, 0), dtype=np.int32),
        T.PIXEL_VALUES: np.zeros((0, 3, image, image), dtype=np.float32),
        T.INPUT_FEATURES: np.zeros((0, audio["feature_size"], audio["max_frames"]), dtype=np.float32),
    }


def media_outputs(media: list[dict], specs: dict) -> dict[str, np.ndarray]:
    """The media output tensors (see the module docstring) of decoded media parts (a kind with no part: empty)."""
    images = [m["array"] for m in media if m["kind"] == "image"]
    audio = [m["array"] for m in media if m["kind"] == "audio"]
    positions = [m["start"] + i for m in media for i in range(m["tokens"])]
    outputs = empty_media_outputs(specs)
    outputs |= {
        T.MEDIA_PARTS: string_tensor(json.dumps([{"kind": m["kind"], "tokens": m["tokens"], "items": 1}
                                                 | ({"frames": m["frames"]} if m["kind"] == "audio" else {})
                                                 for m in media])),
        T.MEDIA_POSITIONS: np.asarray(positions, dtype=np.int32),
    }
    if images:
        outputs[T.PIXEL_VALUES] = np.stack(images).astype(np.float32)
    if audio:
        outputs[T.INPUT_FEATURES] = np.stack(audio).astype(np.float32)
    return outputs
