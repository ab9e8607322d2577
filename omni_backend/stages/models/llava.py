"""LLaVA (Liu et al. 2023, "Visual Instruction Tuning"): a CLIP/SigLIP tower and an MLP projector, one item per
image.

    encoder     one image [3, S, S] -> tower, hidden states of `vision_feature_layer` (CLS dropped for the
                "default" strategy) -> MLP -> [N, H], as `get_image_features` of transformers 5's
                modeling_llava.py computes it
    processor   an image -> one item of the processor's image-token count
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from omni_backend.stages.hf_prompt import ProcessorPrompt, pixel_items


class LlavaEncoder(nn.Module):
    """LLaVA: images [B, 3, S, S] -> [B, N, text hidden], N = (S/patch)² (+1 for the "full" strategy)."""

    checkpoint_prefixes = {"vision_tower": ("vision_tower.", "model.vision_tower."),
                           "multi_modal_projector": ("multi_modal_projector.", "model.multi_modal_projector.")}

    def __init__(self, config):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.feature_layer = config.vision_feature_layer
        self.strategy = config.vision_feature_select_strategy
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)

    def forward(self, pixel_values: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        states = self.vision_tower(pixel_values, output_hidden_states=True).hidden_states
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        selected = [states[i][:, 1:] if self.strategy == "default" else states[i] for i in layers]
        return self.multi_modal_projector(torch.cat(selected, dim=-1))


class LlavaPrompt(ProcessorPrompt):
    """LLaVA prompts (`ProcessorPrompt`): each image is one encoder item of the same token count."""

    kind = "image"

    def _processor_media(self, media: list) -> dict:
        return {"images": media}

    def _parts(self, ids: list[int], encoded: dict, count: int) -> tuple[list[dict], dict[str, np.ndarray]]:
        tokens = sum(1 for i in ids if i == self.token_id) // count
        return [{"kind": "image", "tokens": tokens, "items": 1} for _ in range(count)], pixel_items(encoded)
