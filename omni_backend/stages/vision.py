"""Vision encoder stage: images -> patch embeddings projected to the LLM's hidden size.

A transformers SigLIP vision tower, 2x2 average pooling of its patch grid (196 patches of a 224x224 image ->
49 tokens), and a linear projector to the LLM hidden size. The checkpoint folder holds `config.json` (the
tower's `SiglipVisionConfig`), `model.safetensors` (tower + projector) and `omni_media.json` (see
`omni_backend.stages.media_spec.MediaSpec`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from omni_backend.stages.media_spec import MediaSpec


class VisionEncoder(nn.Module):
    """SigLIP tower -> pool x pool average pooling -> Linear(tower hidden, LLM hidden)."""

    kind = "image"

    def __init__(self, config, out_hidden: int, pool: int = 2):
        super().__init__()
        from transformers import SiglipVisionModel

        self.config, self.pool = config, pool
        self.tower = SiglipVisionModel(config)
        self.projector = nn.Linear(config.hidden_size, out_hidden)

    @property
    def grid(self) -> int:
        return self.config.image_size // self.config.patch_size

    def tokens(self) -> int:
        """Placeholder tokens per image."""
        return math.ceil(self.grid / self.pool) ** 2

    def forward(self, pixel_values: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """[B, 3, S, S] normalized pixels -> [B, tokens, out_hidden] (`lengths` is unused: images have no
        padding)."""
        hidden = self.tower(pixel_values=pixel_values).last_hidden_state  # [B, grid*grid, H]
        b, _, h = hidden.shape
        grid = hidden.transpose(1, 2).reshape(b, h, self.grid, self.grid)
        pooled = nn.functional.avg_pool2d(grid, self.pool, ceil_mode=True)  # [B, H, g', g']
        return self.projector(pooled.flatten(2).transpose(1, 2))

    def spec(self, placeholder_token: str) -> MediaSpec:
        processor = dict(image_size=self.config.image_size, mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])
        return MediaSpec(kind=self.kind, placeholder_token=placeholder_token, hidden_size=self.projector.out_features,
                         pool=self.pool, tokens=self.tokens(), processor=processor)

    @classmethod
    def from_config(cls, config_dict: dict, spec: MediaSpec) -> "VisionEncoder":
        from transformers import SiglipVisionConfig

        return cls(SiglipVisionConfig(**config_dict), spec.hidden_size, spec.pool)
