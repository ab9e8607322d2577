"""Build the embedded default image model: a tiny random Stable-Diffusion-class pipeline, saved once at setup.

The pipeline is a real diffusers `StableDiffusionPipeline` (UNet2DConditionModel with cross-attention,
AutoencoderKL, CLIP text encoder, DDIM scheduler with Stable Diffusion 1.x's noise schedule) whose weights are
random (seeded, so every machine builds the same one) and tiny (under 1 M parameters), with a byte-level
tokenizer (ByT5's, which needs no vocabulary file). Its images are noise: it exists so the diffusion stage, the
batching and the API run end to end offline. Point `OMNI_DIFFUSION_MODEL_PATH` at a real Stable Diffusion
checkpoint folder (diffusers layout) to serve real images through the same stage.

Saved to `<cache>/models/tiny-sd-random` in diffusers' folder layout (`model_index.json` + one folder per part).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from omni_backend import paths

MODEL_NAME = "tiny-sd-random"
SEED = 0
# Bump when the recipe below changes, so setup rebuilds an old copy.
RECIPE_VERSION = "1"


def checkpoint_dir() -> Path:
    """`<cache>/models/tiny-sd-random` (absolute)."""
    return paths.models_dir() / MODEL_NAME


def is_complete(target: Path) -> bool:
    stamp = target / "omni_recipe.txt"
    return (target / "model_index.json").is_file() and stamp.is_file() and stamp.read_text().strip() == RECIPE_VERSION


def build_pipeline():
    """The tiny random pipeline, in memory (deterministic: weights drawn from seed `SEED`)."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import ByT5Tokenizer, CLIPTextConfig, CLIPTextModel

    torch.manual_seed(SEED)
    unet = UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
    )
    # Four blocks: 8x downsampling like Stable Diffusion's VAE (a 256x256 image is a 32x32 latent).
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16, 32, 32), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=8, sample_size=256,
    )
    tokenizer = ByT5Tokenizer(model_max_length=77)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    ))
    # Stable Diffusion 1.x's noise schedule.
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    return StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def ensure_checkpoint(target: Path | None = None, log=print) -> bool:
    """Build and save the pipeline to `target` unless it is already there (a few seconds, once).

    Returns:
        True when it was built.
    """
    target = (target or checkpoint_dir()).absolute()
    if is_complete(target):
        return False
    started = time.monotonic()
    log(f"[setup] building the tiny random Stable Diffusion pipeline in {target}")
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    build_pipeline().save_pretrained(staging)
    (staging / "omni_recipe.txt").write_text(RECIPE_VERSION + "\n")
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(target)
    log(f"[setup] {MODEL_NAME} ready in {time.monotonic() - started:.0f} s")
    return True


if __name__ == "__main__":  # `python -m omni_backend.setup.tiny_sd` (scripts/setup.sh)
    import sys

    sys.stdout.reconfigure(line_buffering=True)
    try:
        ensure_checkpoint()
    except (RuntimeError, ValueError, OSError, ImportError) as exc:
        print(f"[setup] error: {exc}", file=sys.stderr)
        sys.exit(1)
