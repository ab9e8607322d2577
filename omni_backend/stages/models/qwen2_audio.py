"""Qwen2-Audio (Chu et al. 2024, "Qwen2-Audio Technical Report"): a Whisper-style encoder with 2x average pooling
and a linear projector, one item per clip.

    encoder     log-mel [128, 3000] + its valid frame count -> encoder -> projector -> [750, H] (the first
                `audio_tokens(frames)` rows are the clip's), as `get_audio_features` of transformers 5's
                modeling_qwen2_audio.py computes it
    processor   a clip -> one item [128, 3000] and its valid frames (`frames`)
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from omni_backend import tensor_names as T
from omni_backend.stages.hf_prompt import ProcessorPrompt


class Qwen2AudioEncoder(nn.Module):
    """Qwen2-Audio: log-mel [B, 128, F] and valid frames [B] (int) -> [B, F // 4, text hidden] (750 rows for
    30 s windows; the first `audio_tokens(frames)` rows are the clip's).

    The padded frames past each clip's length are masked out of the encoder's attention, as
    `Qwen2AudioForConditionalGeneration` does with `feature_attention_mask`.
    """

    checkpoint_prefixes = {"audio_tower": ("audio_tower.", "model.audio_tower."),
                           "multi_modal_projector": ("multi_modal_projector.", "model.multi_modal_projector.")}

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen2_audio.modeling_qwen2_audio import (Qwen2AudioEncoder as Tower,
                                                                          Qwen2AudioMultiModalProjector)

        self.audio_tower = Tower(config.audio_config)
        self.multi_modal_projector = Qwen2AudioMultiModalProjector(config)

    def forward(self, input_features: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        batch, _, frames = input_features.shape
        if lengths is None:
            lengths = torch.full((batch,), frames, dtype=torch.long)
        feature_lengths = (lengths.to(torch.long) - 1) // 2 + 1  # after the stride-2 convolution
        max_len = (frames - 2) // 2 + 1
        valid = (torch.arange(max_len)[None, :] < feature_lengths[:, None]).to(torch.long)
        dummy = torch.zeros((batch, max_len, 1), dtype=input_features.dtype)
        mask = create_bidirectional_mask(config=self.audio_tower.config, inputs_embeds=dummy, attention_mask=valid)
        hidden = self.audio_tower(input_features, attention_mask=mask).last_hidden_state
        return self.multi_modal_projector(hidden)


def audio_tokens(frames: int) -> int:
    """Embeddings a Qwen2-Audio clip of `frames` valid mel frames gets (its processor's count, and the rows of
    `Qwen2AudioEncoder`'s output that belong to it)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


class Qwen2AudioPrompt(ProcessorPrompt):
    """Qwen2-Audio prompts (`ProcessorPrompt`): each clip is one encoder item with its valid frame count."""

    kind = "audio"

    def _processor_media(self, media: list) -> dict:
        return {"audio": media, "sampling_rate": self.sampling_rate}

    def _parts(self, ids: list[int], encoded: dict, count: int) -> tuple[list[dict], dict[str, np.ndarray]]:
        frames = [int(n) for n in np.asarray(encoded["feature_attention_mask"]).sum(axis=-1)]
        parts = [{"kind": "audio", "tokens": audio_tokens(n), "items": 1, "frames": n} for n in frames]
        return parts, {T.INPUT_FEATURES: np.asarray(encoded["input_features"], dtype=np.float32)}
