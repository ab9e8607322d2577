"""Idefics3 (Laurençon et al. 2024, "Building and better understanding vision-language models"), the architecture of
SmolVLM's (v1) checkpoints: a SigLIP-style tower, a pixel-shuffle connector, the image split into crops.

    encoder     one image crop [3, S, S] -> tower -> pixel-shuffle connector -> [S²/(p·r)², H], as
                `get_image_features` of transformers 5's modeling_idefics3.py computes it
    processor   an image -> its crops, each one item of `image_seq_len` placeholders (the global image last,
                behind `<global-img>`)
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from omni_backend.stages.hf_prompt import ProcessorPrompt, pixel_items


class Idefics3Encoder(nn.Module):
    """Idefics3: pixel crops [B, 3, S, S] -> [B, (S/patch)² / scale_factor², text hidden].

    Padded pixels (the image processor pads with exact zeros, `do_pad`) are masked out of the tower's attention,
    as transformers does with `pixel_attention_mask`; the mask is rebuilt here from the zeros.
    """

    checkpoint_prefixes = {"vision_model": ("model.vision_model.",), "connector": ("model.connector.",)}

    def __init__(self, config):
        super().__init__()
        from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

        self.patch_size = config.vision_config.patch_size
        self.vision_model = Idefics3VisionTransformer(config.vision_config)
        self.connector = Idefics3Connector(config)

    def forward(self, pixel_values: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        pixel_mask = (pixel_values != 0).any(dim=1)  # [B, S, S]
        p = self.patch_size
        patch_mask = pixel_mask.unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0
        # An all-zero crop (transformers drops such "padding images" before the tower) attends to every patch
        # here instead of to none, so it gives finite embeddings; the processor never makes one for an image.
        patch_mask |= ~patch_mask.flatten(1).any(dim=1)[:, None, None]
        hidden = self.vision_model(pixel_values=pixel_values, patch_attention_mask=patch_mask).last_hidden_state
        return self.connector(hidden)


class Idefics3Prompt(ProcessorPrompt):
    """Idefics3 prompts (`ProcessorPrompt`): every crop of an image is one encoder item."""

    kind = "image"

    def _processor_media(self, media: list) -> dict:
        return {"images": [media]}  # one sample holding every image

    def _parts(self, ids: list[int], encoded: dict, count: int) -> tuple[list[dict], dict[str, np.ndarray]]:
        """One run of image_seq_len placeholders per crop; an image's runs end with the one behind its
        <global-img> tag.

        Raises:
            ValueError: runs that do not group into `count` images of the processor's crops.
        """
        items = pixel_items(encoded)
        num_items = len(next(iter(items.values())))
        global_id = self.processor.tokenizer.convert_tokens_to_ids(self.processor.global_image_tag)
        parts, runs = [], []
        index = 0
        while index < len(ids):
            if ids[index] != self.token_id:
                index += 1
                continue
            start = index
            while index < len(ids) and ids[index] == self.token_id:
                index += 1
            runs.append(index - start)
            if start > 0 and ids[start - 1] == global_id:
                parts.append({"kind": "image", "tokens": sum(runs), "items": len(runs)})
                runs = []
        if runs or len(parts) != count or sum(p["items"] for p in parts) != num_items:
            raise ValueError(f"the processor's image expansion ({len(parts)} images, "
                             f"{sum(p['items'] for p in parts)} crops) does not match its {count} images "
                             f"and {num_items} crops")
        return parts, items
