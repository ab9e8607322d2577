"""The media towers and connectors of Hugging Face multimodal checkpoints, run by the encoder stages.

Each encoder is the class the model registry names for the checkpoint's architecture and media kind
(omni_backend/engine/models/registry.py; the classes are in omni_backend/stages/models/), built from
transformers' own module classes and the checkpoint's `config.json`, and loaded from its safetensors under the
checkpoint's own tensor names (no conversion step). Its forward is what the architecture's `get_image_features` /
`get_audio_features` computes in transformers 5, one item per row. An encoder class has `checkpoint_prefixes`
(attribute -> where the checkpoint keeps that submodule) and `forward(values [B, ...], lengths [B] | None)`.
"""

from __future__ import annotations

import glob
from contextlib import ExitStack
from pathlib import Path

from safetensors import safe_open
from torch import nn

from omni_backend import checkpoints
from omni_backend.engine.models import registry


def load_hf_encoder(folder: str | Path, kind: str) -> nn.Module:
    """The `kind` encoder of a multimodal checkpoint folder, float32, in eval mode, on the CPU.

    Raises:
        ValueError: the folder's architecture is unsupported or reads no `kind` media.
        KeyError: a weight the encoder needs is missing from the checkpoint.
    """
    from transformers import AutoConfig

    architecture = checkpoints.multimodal_architecture(folder)
    if architecture is None or kind not in architecture.encoders:
        raise ValueError(f"the checkpoint in {folder} has no {kind} encoder")
    model = registry.load(architecture.encoders[kind])(AutoConfig.from_pretrained(folder))
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
