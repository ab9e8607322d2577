"""What the preprocess stage needs to know about an image or audio encoder, and where its checkpoint folder is.

The encoder of a kind comes from a Hugging Face multimodal checkpoint (`omni_backend.checkpoints`: the LLM's own
folder, or a configured one) or from a project encoder folder. A project encoder folder holds `config.json` (the
tower's transformers config), `model.safetensors` (tower and projector weights; omni_backend/stages/media_encoder.py
loads them) and `omni_media.json`, the `MediaSpec` read here. This module imports neither torch nor transformers,
so preprocess can use it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from omni_backend import checkpoints, paths
from omni_backend.engine.models.registry import Architecture

SPEC_FILE = "omni_media.json"
DEFAULT_DIRS = {"image": "tiny-omni-vision", "audio": "tiny-omni-audio"}
ENV_VARS = {"image": "OMNI_VISION_MODEL_PATH", "audio": "OMNI_AUDIO_MODEL_PATH"}


@dataclass
class MediaSpec:
    """What the preprocess stage needs to know about an encoder (stored as `omni_media.json`)."""

    kind: str  # "image" or "audio"
    placeholder_token: str  # the LLM token written at each embedding position
    hidden_size: int  # LLM hidden size (projector output)
    pool: int
    tokens: int  # tokens per image; per 30 s window for audio (clips use fewer)
    processor: dict = field(default_factory=dict)

    @classmethod
    def load(cls, folder: str | Path) -> "MediaSpec":
        return cls(**json.loads((Path(folder) / SPEC_FILE).read_text()))


def encoder_path(kind: str, configured: str = "") -> Path:
    """Checkpoint folder: the configured path, else `$OMNI_VISION_MODEL_PATH`/`$OMNI_AUDIO_MODEL_PATH`, else the
    tiny random default under `<cache>/models/`."""
    return Path(configured or os.environ.get(ENV_VARS[kind]) or paths.models_dir() / DEFAULT_DIRS[kind]).absolute()


@dataclass(frozen=True)
class MediaSource:
    """Where a kind's encoder comes from.

    Attributes:
        folder: the checkpoint folder (absolute).
        architecture: the model registry's row of a Hugging Face multimodal checkpoint; None for a project
            encoder folder (`omni_media.json` + tower + projector).
    """

    folder: Path
    architecture: Architecture | None = None


def media_source(kind: str, configured: str = "", llm_model_path: str = "") -> MediaSource | None:
    """The encoder of `kind` ("image"/"audio"), None when the server has none.

    A multimodal LLM checkpoint brings the encoder of the media it reads. Every other kind comes from a project
    encoder folder: the configured one, else `$OMNI_VISION_MODEL_PATH`/`$OMNI_AUDIO_MODEL_PATH`, else the tiny
    random default under `<cache>/models/`. Beside a multimodal checkpoint, such a folder serves only when its
    embeddings have the language model's width (the default audio encoder beside the default SmolVLM-shaped
    checkpoint); an Idefics3 folder of another width has no audio encoder.

    Raises:
        ValueError: an unsupported architecture in the LLM folder (`omni_backend.checkpoints`).
    """
    architecture = checkpoints.multimodal_architecture(llm_model_path) if llm_model_path else None
    if architecture is not None and kind in architecture.encoders:
        return MediaSource(Path(llm_model_path).absolute(), architecture)
    folder = encoder_path(kind, configured)
    if architecture is not None:
        if not (folder / SPEC_FILE).is_file():
            return None
        if MediaSpec.load(folder).hidden_size != checkpoints.text_hidden_size(llm_model_path):
            return None
    return MediaSource(folder)
