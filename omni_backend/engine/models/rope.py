"""Rotary position embedding tables (Su et al., "RoFormer", 2021) with the config's scaling.

Supported `rope_type`s: "default"; "linear" (position interpolation, Chen et al. 2023: frequencies divided by
`factor`); "llama3" (Meta's Llama 3.1 frequency-dependent scaling: wavelengths above
original_max_position_embeddings / low_freq_factor are divided by `factor`, those below
.../high_freq_factor kept, smooth interpolation between; constants from the model's config).
"""

from __future__ import annotations

import math

import torch


def rope_parameters(config) -> dict:
    """The config's RoPE settings as one dict with at least rope_type and rope_theta.

    transformers 5 keeps them in `config.rope_parameters`; older configs use `rope_theta` + `rope_scaling`.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    """inv_freq [head_dim // 2] float32 after scaling.

    Raises:
        ValueError: unsupported rope_type.
    """
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low = float(params["low_freq_factor"])
        high = float(params["high_freq_factor"])
        original = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, llama3)")


def cos_sin_cache(head_dim: int, max_positions: int, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, head_dim] float32 on CPU (half-split layout, as HF's rotate_half)."""
    with torch.device("cpu"):
        inv_freq = inverse_frequencies(head_dim, params)
        positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by per-token cos/sin [T, head_dim] (half-split pairing)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
