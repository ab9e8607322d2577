"""Build the tiny default encoders: random-initialized SigLIP vision and Whisper audio towers with projectors to
the SmolLM2 hidden size (576), from real transformers configs, with a fixed seed (same weights every build).

Their image/audio understanding is NOT meaningful: the weights are random. They exercise the whole serving path
(decode, encode, batch, splice into the prompt). Point OMNI_VISION_MODEL_PATH / OMNI_AUDIO_MODEL_PATH at real
checkpoints folders in the same layout to serve a real model (docs/api.md, "Image and audio input").
"""

from __future__ import annotations

import shutil
from pathlib import Path

from omni_backend.stages.media_spec import SPEC_FILE, encoder_path

LLM_HIDDEN = 576  # SmolLM2-135M
PLACEHOLDER = "<empty_output>"  # a rarely used special token of the SmolLM2 tokenizer (id 16)
SEED = 1234

# google/siglip-base-patch16-224's vision config, cut to 2 layers (the tiny default stays light on CPU).
SIGLIP_VISION = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=2,
                     image_size=224, patch_size=16, num_channels=3, hidden_act="gelu_pytorch_tanh",
                     layer_norm_eps=1e-6)
# openai/whisper-tiny's encoder config (4 layers, d_model 384, 80 mel bins, 30 s windows).
WHISPER_TINY = dict(d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                    decoder_layers=4, decoder_attention_heads=6, decoder_ffn_dim=1536, num_mel_bins=80,
                    max_source_positions=1500, max_target_positions=448, vocab_size=51865,
                    pad_token_id=50257, bos_token_id=50257, eos_token_id=50257, decoder_start_token_id=50258)


def ensure_encoders(log=print) -> bool:
    """Build both default encoders unless present. Returns True when something was built."""
    built = False
    for kind in ("image", "audio"):
        target = encoder_path(kind, str(_default(kind)))
        if (target / SPEC_FILE).is_file():
            continue
        import torch

        from omni_backend.stages.media_encoder import save_encoder

        torch.manual_seed(SEED)
        if kind == "image":
            from transformers import SiglipVisionConfig

            from omni_backend.stages.vision import VisionEncoder

            model = VisionEncoder(SiglipVisionConfig(**SIGLIP_VISION), LLM_HIDDEN, pool=2)
        else:
            from transformers import WhisperConfig

            from omni_backend.stages.audio import AudioEncoder

            model = AudioEncoder(WhisperConfig(**WHISPER_TINY), LLM_HIDDEN, pool=4)
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        save_encoder(model, staging, PLACEHOLDER)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        log(f"[setup] built the tiny random {kind} encoder in {target}")
        built = True
    return built


def _default(kind: str) -> Path:
    from omni_backend import paths
    from omni_backend.stages.media_spec import DEFAULT_DIRS

    return paths.models_dir() / DEFAULT_DIRS[kind]
