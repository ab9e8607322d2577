"""What the preprocess stage needs to know about an image or audio encoder, and where its checkpoint folder is.

An encoder folder holds `config.json` (the tower's transformers config), `model.safetensors` (tower and projector
weights; omni_backend/stages/media_encoder.py loads them) and `omni_media.json`, the `MediaSpec` read here. This
module imports neither torch nor transformers, so preprocess can use it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from omni_backend import paths

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
