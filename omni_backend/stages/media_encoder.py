"""Encoder checkpoints (vision/audio tower + projector) and the batched encoder stage shared by both.

Checkpoint folder layout: `config.json` (the tower's transformers config), `model.safetensors` (tower and
projector weights) and `omni_media.json` (`media_spec.MediaSpec`: kind, placeholder token, LLM hidden size,
pooling, processor settings). The preprocess stage reads only `omni_media.json`; the encoder stages load
everything.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from omni_backend.stages.encoder_cache import EncoderCache, content_key
from omni_backend.stages.media_spec import SPEC_FILE, MediaSpec, encoder_path


def save_encoder(model, folder: Path, placeholder_token: str) -> None:
    """Write an encoder (VisionEncoder/AudioEncoder) as a checkpoint folder."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(model.config.to_json_string())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / SPEC_FILE).write_text(json.dumps(asdict(model.spec(placeholder_token)), indent=2))


def load_encoder(folder: str | Path, device: str = "cpu", dtype=None):
    """Load a checkpoint folder written by `save_encoder` (eval mode)."""
    import torch
    from safetensors.torch import load_file

    from omni_backend.stages.audio import AudioEncoder
    from omni_backend.stages.vision import VisionEncoder

    folder = Path(folder)
    spec = MediaSpec.load(folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("transformers_version", None)
    cls = {"image": VisionEncoder, "audio": AudioEncoder}[spec.kind]
    model = cls.from_config(config, spec)
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    return model.to(device=device, dtype=dtype or torch.float32).eval()


class EncoderStage:
    """Runs one encoder on a dynamic batch: the items (images or clips) of every request that the encoder cache
    (`encoder_cache.py`) does not hold are concatenated into one forward pass, each distinct item once.

    Args:
        model: a loaded VisionEncoder or AudioEncoder.
        cache: the encoder cache (a new one of the default size when None).

    Attributes:
        num_items: items received so far (counter).
        num_encoded: of those, items run through the encoder (counter); the others came from the cache or were
            repeated in their batch.
    """

    def __init__(self, model, device: str = "cpu", cache: EncoderCache | None = None):
        self.model, self.device = model, device
        self.dtype = next(model.parameters()).dtype
        self.cache = cache if cache is not None else EncoderCache()
        self.num_items = 0
        self.num_encoded = 0

    def run(self, batches: list[np.ndarray]) -> list[np.ndarray]:
        """Arrays [b_i, ...] per request -> float32 embeddings [b_i, tokens, hidden] per request.

        Raises:
            ValueError: requests whose item shapes differ (Triton batches only equal shapes).
        """
        import torch

        shapes = {tuple(a.shape[1:]) for a in batches}
        if len(shapes) != 1:
            raise ValueError(f"encoder inputs in one batch must have equal shapes, got {sorted(shapes)}")
        items = [np.asarray(item, dtype=np.float32) for batch in batches for item in batch]
        keys = [content_key(item) for item in items]
        self.num_items += len(items)
        found = {key: self.cache.get(key) for key in dict.fromkeys(keys)}
        missing = [key for key, value in found.items() if value is None]
        if missing:
            first = {key: index for index, key in reversed(list(enumerate(keys)))}
            stacked = torch.from_numpy(np.stack([items[first[key]] for key in missing]))
            with torch.inference_mode():
                out = self.model(stacked.to(self.device, self.dtype)).float().cpu().numpy()
            self.num_encoded += len(missing)
            for key, value in zip(missing, out):
                found[key] = value
                self.cache.put(key, value.copy())  # a view would keep the whole batch output alive
        rows = [found[key] for key in keys]
        sizes = np.cumsum([batch.shape[0] for batch in batches])
        return [np.stack(rows[start:end]) for start, end in zip([0, *sizes[:-1]], sizes)]


def create_stage(kind: str, parameters: dict[str, str]) -> EncoderStage:
    """The encoder stage from a model's config parameters (`model_path`, `device`, `dtype`, and on a GPU its
    share of device memory, `gpu_memory_fraction`: ops/gpu_budget.py).

    Raises:
        ValueError: a malformed device or memory fraction; RuntimeError: a CUDA device torch cannot use.
    """
    import torch

    from omni_backend.ops.gpu_budget import apply_gpu_memory_budget
    from omni_backend.ops.hardware import resolve_device

    device = resolve_device(parameters.get("device") or "auto")
    apply_gpu_memory_budget(device, float(parameters.get("gpu_memory_fraction") or 1.0), f"{kind}_encoder")
    dtype_name = parameters.get("dtype") or "auto"
    dtype = torch.float32 if dtype_name == "auto" else getattr(torch, dtype_name)
    if dtype_name == "auto" and device.startswith("cuda"):
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return EncoderStage(load_encoder(encoder_path(kind, parameters.get("model_path", "")), device, dtype), device)


def splice_embeddings(parts: list[dict], positions: np.ndarray, outputs: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The llm's `prompt_embeds` [k, hidden] and `prompt_embed_positions` [k] from each part's encoder output.

    Args:
        parts: preprocess's `media_parts` ({"kind", "tokens"} in prompt order).
        positions: preprocess's `media_positions` (k placeholder positions, in the same order).
        outputs: one encoder output [1 or more, >= tokens, hidden] per part; the first `tokens` rows are used.

    Raises:
        ValueError: the counts disagree.
    """
    rows = [np.asarray(out).reshape(-1, np.asarray(out).shape[-1])[: part["tokens"]]
            for out, part in zip(outputs, parts)]
    embeds = np.ascontiguousarray(np.concatenate(rows), dtype=np.float32)
    positions = np.asarray(positions, dtype=np.int32).reshape(-1)
    if embeds.shape[0] != positions.size:
        raise ValueError(f"encoders gave {embeds.shape[0]} embeddings for {positions.size} placeholders")
    return {"prompt_embeds": embeds, "prompt_embed_positions": positions}
