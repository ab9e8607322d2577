"""Audio encoder stage: 16 kHz log-mel features -> frame embeddings projected to the LLM's hidden size.

A transformers Whisper encoder (30 s windows: 3000 mel frames -> 1500 frames), average pooling by `pool`
(default 4: one token per 80 ms), and a linear projector to the LLM hidden size. A clip shorter than 30 s uses
only its own frames: `tokens_for(samples)` placeholders, the first rows of the encoder output.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from omni_backend.stages.media_spec import MediaSpec

HOP_LENGTH = 160  # Whisper's mel hop at 16 kHz (10 ms)


class AudioEncoder(nn.Module):
    """Whisper encoder -> average pooling over time -> Linear(d_model, LLM hidden)."""

    kind = "audio"

    def __init__(self, config, out_hidden: int, pool: int = 4):
        super().__init__()
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        self.config, self.pool = config, pool
        self.tower = WhisperEncoder(config)
        self.projector = nn.Linear(config.d_model, out_hidden)

    @property
    def max_frames(self) -> int:
        """Mel frames of one window (3000 for 30 s)."""
        return self.config.max_source_positions * 2

    def tokens_for(self, num_samples: int) -> int:
        """Placeholder tokens for a clip of `num_samples` at 16 kHz."""
        return tokens_for_frames(min(self.max_frames, math.ceil(num_samples / HOP_LENGTH)), self.pool)

    def forward(self, input_features: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """[B, mel bins, max_frames] -> [B, ceil(max_frames / 2 / pool), out_hidden]. The valid frames
        (`lengths`) are not used: this encoder attends over the whole window, and a clip takes its first rows."""
        hidden = self.tower(input_features).last_hidden_state  # [B, max_source_positions, d_model]
        pooled = nn.functional.avg_pool1d(hidden.transpose(1, 2), self.pool, ceil_mode=True)
        return self.projector(pooled.transpose(1, 2))

    def spec(self, placeholder_token: str) -> MediaSpec:
        processor = dict(feature_size=self.config.num_mel_bins, max_frames=self.max_frames,
                         hop_length=HOP_LENGTH)
        return MediaSpec(kind=self.kind, placeholder_token=placeholder_token, hidden_size=self.projector.out_features,
                         pool=self.pool, tokens=math.ceil(self.max_frames / 2 / self.pool), processor=processor)

    @classmethod
    def from_config(cls, config_dict: dict, spec: MediaSpec) -> "AudioEncoder":
        from transformers import WhisperConfig

        return cls(WhisperConfig(**config_dict), spec.hidden_size, spec.pool)


def tokens_for_frames(frames: int, pool: int) -> int:
    """Embeddings a clip of `frames` mel frames gets: the encoder halves the frame rate, then pools by `pool`."""
    return max(1, math.ceil(math.ceil(frames / 2) / pool))


def log_mel(samples, feature_size: int = 80, max_frames: int = 3000):
    """16 kHz float samples -> float32 [feature_size, max_frames] log-mel features (Whisper's extractor)."""
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=feature_size, n_samples=max_frames * HOP_LENGTH,
                                        nb_max_frames=max_frames)
    return extractor(samples, sampling_rate=16_000, return_tensors="np").input_features[0]
