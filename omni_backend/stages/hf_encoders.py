"""The media towers and connectors of Hugging Face multimodal checkpoints, run by the encoder stages.

Each encoder is built from transformers' own module classes and the checkpoint's `config.json`, and loaded
from its safetensors under the checkpoint's own tensor names (no conversion step). Its forward is what the
architecture's `get_image_features` / `get_audio_features` computes in transformers 5 (modeling_idefics3.py,
modeling_smolvlm.py, modeling_llava.py, modeling_qwen2_audio.py), one item per row:

    Idefics3 / SmolVLM  one image crop [3, S, S]  -> SigLIP-style tower -> pixel-shuffle connector -> [S²/(p·r)², H]
    LLaVA               one image [3, S, S]       -> CLIP/SigLIP tower, hidden states of `vision_feature_layer`
                                                     (CLS dropped for the "default" strategy) -> MLP -> [N, H]
    Qwen2-Audio         log-mel [128, 3000] + its valid frame count -> Whisper-style encoder with 2x average
                                                     pooling -> linear projector -> [750, H] (the first
                                                     `(frames - 1) // 2 // 2 + 1` rows are the clip's)
"""

from __future__ import annotations

import glob
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from omni_backend import checkpoints


def load_hf_encoder(folder: str | Path, kind: str) -> nn.Module:
    """The `kind` encoder of a multimodal checkpoint folder, float32, in eval mode, on the CPU.

    Raises:
        ValueError: the folder's architecture is unsupported or reads no `kind` media.
        KeyError: a weight the encoder needs is missing from the checkpoint.
    """
    from transformers import AutoConfig

    architecture = checkpoints.multimodal_architecture(folder)
    if architecture is None or architecture.kind != kind:
        raise ValueError(f"the checkpoint in {folder} has no {kind} encoder")
    config = AutoConfig.from_pretrained(folder)
    cls = {"Idefics3ForConditionalGeneration": Idefics3Encoder, "SmolVLMForConditionalGeneration": Idefics3Encoder,
           "LlavaForConditionalGeneration": LlavaEncoder,
           "Qwen2AudioForConditionalGeneration": Qwen2AudioEncoder}[architecture.name]
    model = cls(config, architecture.name)
    load_prefixed_weights(model, folder)
    return model.float().eval()


def load_prefixed_weights(model: nn.Module, folder: str | Path) -> None:
    """Copy the checkpoint tensors named `<prefix><parameter name>` into `model`, for each of its submodules'
    `checkpoint_prefixes` (one of them must match). A tower whose checkpoint names carry or lack the
    `vision_model.` level of transformers' `*VisionModel` wrappers is found either way.

    Raises:
        KeyError: a parameter or buffer with no tensor in the checkpoint.
    """
    files = sorted(glob.glob(str(Path(folder) / "*.safetensors")))
    with ExitStack() as stack:
        where = {}
        for path in files:
            handle = stack.enter_context(safe_open(path, framework="pt"))
            where.update((name, handle) for name in handle.keys())
        state = {}
        for attribute, prefixes in model.checkpoint_prefixes.items():
            for name, _ in getattr(model, attribute).state_dict().items():
                candidates = [p + name for p in prefixes]
                candidates += [p + name.removeprefix("vision_model.") for p in prefixes]
                candidates += [p + "vision_model." + name for p in prefixes]
                stored = next((c for c in candidates if c in where), None)
                if stored is None:
                    if name.endswith("position_ids"):  # a buffer transformers rebuilds, not always saved
                        continue
                    raise KeyError(f"checkpoint {folder} lacks the weight of {attribute}.{name} "
                                   f"(looked for {candidates[0]!r})")
                state[f"{attribute}.{name}"] = where[stored].get_tensor(stored)
    model.load_state_dict(state, strict=False)


class Idefics3Encoder(nn.Module):
    """Idefics3 / SmolVLM: pixel crops [B, 3, S, S] -> [B, (S/patch)² / scale_factor², text hidden].

    Padded pixels (the image processor pads with exact zeros, `do_pad`) are masked out of the tower's attention,
    as transformers does with `pixel_attention_mask`; the mask is rebuilt here from the zeros.
    """

    checkpoint_prefixes = {"vision_model": ("model.vision_model.",), "connector": ("model.connector.",)}

    def __init__(self, config, architecture: str):
        super().__init__()
        if architecture.startswith("SmolVLM"):
            from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector as Connector
            from transformers.models.smolvlm.modeling_smolvlm import SmolVLMVisionTransformer as Tower
        else:
            from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector as Connector
            from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer as Tower
        self.patch_size = config.vision_config.patch_size
        self.vision_model = Tower(config.vision_config)
        self.connector = Connector(config)

    def forward(self, pixel_values: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        pixel_mask = (pixel_values != 0).any(dim=1)  # [B, S, S]
        p = self.patch_size
        patch_mask = pixel_mask.unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0
        # An all-zero crop (transformers drops such "padding images" before the tower) attends to every patch
        # here instead of to none, so it gives finite embeddings; the processor never makes one for an image.
        patch_mask |= ~patch_mask.flatten(1).any(dim=1)[:, None, None]
        hidden = self.vision_model(pixel_values=pixel_values, patch_attention_mask=patch_mask).last_hidden_state
        return self.connector(hidden)


class LlavaEncoder(nn.Module):
    """LLaVA: images [B, 3, S, S] -> [B, N, text hidden], N = (S/patch)² (+1 for the "full" strategy)."""

    checkpoint_prefixes = {"vision_tower": ("vision_tower.", "model.vision_tower."),
                           "multi_modal_projector": ("multi_modal_projector.", "model.multi_modal_projector.")}

    def __init__(self, config, architecture: str):
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


class Qwen2AudioEncoder(nn.Module):
    """Qwen2-Audio: log-mel [B, 128, F] and valid frames [B] (int) -> [B, F // 4, text hidden] (750 rows for
    30 s windows; the first `audio_tokens(frames)` rows are the clip's).

    The padded frames past each clip's length are masked out of the encoder's attention, as
    `Qwen2AudioForConditionalGeneration` does with `feature_attention_mask`.
    """

    checkpoint_prefixes = {"audio_tower": ("audio_tower.", "model.audio_tower."),
                           "multi_modal_projector": ("multi_modal_projector.", "model.multi_modal_projector.")}

    def __init__(self, config, architecture: str):
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
