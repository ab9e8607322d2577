"""Encoder checkpoints (vision/audio tower + projector), the batched encoder stage shared by both, and how a
request's media items become encoder calls and then llm prompt embeddings.

An encoder is a Hugging Face multimodal checkpoint's tower and connector (stages/hf_encoders.py) or a project
encoder folder: `config.json` (the tower's transformers config), `model.safetensors` (tower and projector
weights) and `omni_media.json` (`media_spec.MediaSpec`: kind, placeholder token, LLM hidden size, pooling,
processor settings). The preprocess stage reads only `omni_media.json`; the encoder stages load everything.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from omni_backend import settings
from omni_backend import tensor_names as T
from omni_backend.ops.metrics import EncoderMetrics
from omni_backend.settings import SettingGroup, setting
from omni_backend.stages.encoder_cache import EncoderCache, content_key
from omni_backend.stages.media_spec import SPEC_FILE, MediaSpec, media_source
from omni_backend.stages.triton_glue import StageModel
from omni_backend.vocabulary import FieldError

# The encoder model and its item input of each media kind (model_repository/{vision,audio}_encoder); an audio
# item also carries its valid mel frames as `input_lengths`. A video's frames are vision items.
ENCODERS = {"image": ("vision_encoder", T.PIXEL_VALUES), "audio": ("audio_encoder", T.INPUT_FEATURES),
            "video": ("vision_encoder", T.PIXEL_VALUES)}


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
        model: a loaded encoder (`forward(items, valid frames or None)`), or None on a server without this kind
            of encoder, whose every request then fails with `missing`.
        cache: the encoder cache (a new one of the default size when None).
        missing: the error message of a stage without a model.

    Attributes:
        num_items: items received so far (counter).
        num_encoded: of those, items run through the encoder (counter); the others came from the cache or were
            repeated in their batch.
    """

    def __init__(self, model, device: str = "cpu", cache: EncoderCache | None = None, missing: str = "",
                 kind: str = "image"):
        self.model, self.device, self.missing, self.kind = model, device, missing, kind
        self.dtype = next(model.parameters()).dtype if model is not None else None
        self.cache = cache if cache is not None else EncoderCache()
        self.num_items = 0
        self.num_encoded = 0

    @property
    def input_names(self) -> tuple[str, ...]:
        """The encoder model's inputs: its items, and for audio their valid frames."""
        name = ENCODERS[self.kind][1]
        return (name, T.INPUT_LENGTHS) if self.kind == "audio" else (name,)

    def run_batch(self, requests: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray] | Exception]:
        """A dynamic batch: each request's input arrays (`input_names`) -> its `embeddings`, or the error of that
        request alone (items that are not finite, valid frames outside [1, frames]); the good ones run together,
        one pass per item shape, and a pass that fails (an item of a shape the encoder cannot read) fails only the
        requests whose items were in it.

        Raises:
            ValueError: this server has no encoder of its kind (every request fails alike).
        """
        if self.model is None:
            raise ValueError(self.missing)
        name = ENCODERS[self.kind][1]
        results: list = [None] * len(requests)
        good: list[int] = []
        for index, arrays in enumerate(requests):
            try:
                self._check(arrays)
                good.append(index)
            except ValueError as exc:
                results[index] = exc
        by_shape: dict[tuple, list[int]] = {}
        for index in good:
            by_shape.setdefault(tuple(requests[index][name].shape[1:]), []).append(index)
        for group in by_shape.values():
            lengths = [requests[i][T.INPUT_LENGTHS].reshape(-1) for i in group] if self.kind == "audio" else None
            try:
                outputs = self.run([requests[i][name] for i in group], lengths)
            except Exception as exc:  # logged with its traceback by the glue's error path: this group only
                outputs = [exc] * len(group)
            for index, out in zip(group, outputs):
                results[index] = out if isinstance(out, Exception) else {T.EMBEDDINGS: np.ascontiguousarray(out)}
        return results

    def _check(self, arrays: dict[str, np.ndarray]) -> None:
        name = ENCODERS[self.kind][1]
        items = arrays.get(name)
        if items is None:
            raise FieldError(name, "is required")
        if not np.isfinite(items).all():
            raise FieldError(name, "must be finite (NaN or infinity in the input)")
        if self.kind == "audio":
            lengths = arrays.get(T.INPUT_LENGTHS)
            if lengths is None or lengths.size != items.shape[0]:
                raise FieldError(T.INPUT_LENGTHS, f"must give one length per item ({items.shape[0]})")
            if lengths.min() < 1 or lengths.max() > items.shape[-1]:
                raise FieldError(T.INPUT_LENGTHS, f"must lie in [1, {items.shape[-1]}] (the items' frames)")

    def run(self, batches: list[np.ndarray], lengths: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Arrays [b_i, ...] per request (and, for audio, valid frames int [b_i] per request) -> float32
        embeddings [b_i, tokens, hidden] per request; items of different shapes run in separate passes.

        Raises:
            ValueError: this server has no encoder of its kind.
        """
        import torch

        if self.model is None:
            raise ValueError(self.missing)
        items = [np.asarray(item, dtype=np.float32) for batch in batches for item in batch]
        frames = ([int(n) for batch in lengths for n in np.asarray(batch).reshape(-1)] if lengths is not None
                  else [-1] * len(items))
        keys = [content_key(item) + n.to_bytes(8, "little", signed=True) for item, n in zip(items, frames)]
        self.num_items += len(items)
        found = {key: self.cache.get(key) for key in dict.fromkeys(keys)}
        first = {key: index for index, key in reversed(list(enumerate(keys)))}
        by_shape: dict[tuple, list[bytes]] = {}
        for key, value in found.items():
            if value is None:
                by_shape.setdefault(items[first[key]].shape, []).append(key)
        for missing in by_shape.values():
            stacked = torch.from_numpy(np.stack([items[first[key]] for key in missing]))
            valid = torch.tensor([frames[first[key]] for key in missing]) if lengths is not None else None
            with torch.inference_mode():
                out = self.model(stacked.to(self.device, self.dtype), valid).float().cpu().numpy()
            self.num_encoded += len(missing)
            for key, value in zip(missing, out):
                found[key] = value
                self.cache.put(key, value.copy())  # a view would keep the whole batch output alive
        rows = [found[key] for key in keys]
        sizes = np.cumsum([batch.shape[0] for batch in batches])
        return [np.stack(rows[start:end]) for start, end in zip([0, *sizes[:-1]], sizes)]


@dataclass
class EncoderSettings(SettingGroup):
    """Settings of the media encoder stages (rendered as `encoder_<field>`, omni_backend/repository.py)."""

    gpu_memory_fraction: float = setting(0.04, "share of each GPU for each media encoder (ops/gpu_budget.py)",
                                         low=0.0, low_open=True, high=1.0)
    model_path: str = setting("", "the encoder checkpoint when the served model brings none; empty: "
                              "$OMNI_VISION_MODEL_PATH / $OMNI_AUDIO_MODEL_PATH, else the tiny random default "
                              "(media_spec.media_source)", operator=False)

    PREFIX = "encoder_"  # the operator's names: encoder_<field>


def create_stage(kind: str, parameters: dict[str, str]) -> EncoderStage:
    """The encoder stage from a model's config parameters: `EncoderSettings`' (`model_path`,
    `gpu_memory_fraction`) and the engine's `llm_model_path` (which encoder: `media_spec.media_source`), `device`
    and `dtype`.

    Raises:
        ValueError: a malformed setting, or an unsupported checkpoint; RuntimeError: a CUDA device torch cannot
            use.
    """
    import torch

    from omni_backend.engine.config import EngineConfig
    from omni_backend.ops.gpu_budget import apply_gpu_memory_budget
    from omni_backend.ops.hardware import resolve_device

    own = EncoderSettings.from_strings(parameters)
    llm_model_path = settings.parse_field(EngineConfig, "model_path", parameters.get("llm_model_path"),
                                          "llm_model_path")
    source = media_source(kind, own.model_path, llm_model_path)
    if source is None:
        return EncoderStage(None, missing=f"this server has no {kind} encoder: its model ({llm_model_path}) reads "
                                          f"no {kind}", kind=kind)
    device = resolve_device(settings.parse_field(EngineConfig, "device", parameters.get("device")))
    apply_gpu_memory_budget(device, own.gpu_memory_fraction, f"{kind}_encoder")
    dtype_name = settings.parse_field(EngineConfig, "dtype", parameters.get("dtype"))
    dtype = torch.float32 if dtype_name == "auto" else getattr(torch, dtype_name)
    if dtype_name == "auto" and device.startswith("cuda"):
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if source.architecture is not None:
        from omni_backend.stages.hf_encoders import load_hf_encoder

        model = load_hf_encoder(source.folder, kind).to(device=device, dtype=dtype)
    else:
        model = load_encoder(source.folder, device, dtype)
    return EncoderStage(model, device, kind=kind)


@dataclass
class EncoderCall:
    """One encoder request of a media item: `inputs` by tensor name, each with a leading batch dimension of 1."""

    part: int  # index of the media part it belongs to
    model: str
    inputs: dict[str, np.ndarray]


def encoder_calls(parts: list[dict], pixel_values: np.ndarray | None,
                  input_features: np.ndarray | None) -> list[EncoderCall]:
    """The encoder requests of a preprocessed request: one per item (an image crop, an image, a clip, a video's
    temporal patch), in order, so the encoders' dynamic batchers merge items across requests.

    Args:
        parts: preprocess's `media_parts` (`kind`, `tokens`, `items` (default 1), audio `frames`, and `size`
            where the items of a part fill only the leading [rows, cols] of their zero-padded tensor rows).
        pixel_values, input_features: preprocess's item tensors [items, ...]; images and videos share
            pixel_values, in part order.

    Raises:
        ValueError: more items named by the parts than the tensors hold.
    """
    arrays = {T.PIXEL_VALUES: pixel_values, T.INPUT_FEATURES: input_features}
    seen = dict.fromkeys(arrays, 0)
    calls = []
    for index, part in enumerate(parts):
        kind = part["kind"]
        model, name = ENCODERS[kind]
        crop = tuple(slice(0, int(n)) for n in part.get("size", ()))
        for _ in range(int(part.get("items", 1))):
            array = arrays[name]
            if array is None or seen[name] >= array.shape[0]:
                raise ValueError(f"media_parts names more {kind} items than {name} holds")
            item = array[seen[name]:seen[name] + 1][(slice(None), *crop)]
            inputs = {name: np.ascontiguousarray(item, dtype=np.float32)}
            if kind == "audio":
                inputs[T.INPUT_LENGTHS] = np.asarray([[int(part["frames"])]], dtype=np.int32)
            seen[name] += 1
            calls.append(EncoderCall(index, model, inputs))
    return calls


def splice_embeddings(parts: list[dict], positions: np.ndarray, calls: list[EncoderCall],
                      outputs: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The llm's `prompt_embeds` [k, hidden] and `prompt_embed_positions` [k] from the encoder outputs.

    Args:
        parts: preprocess's `media_parts` ({"kind", "tokens", ...} in prompt order).
        positions: preprocess's `media_positions` (k placeholder positions, in the same order).
        calls: `encoder_calls(...)`; outputs: each call's `embeddings` [1, rows, hidden]. A part's embeddings
            are its items' rows in order, the first `tokens` of them.

    Raises:
        ValueError: the counts disagree.
    """
    rows: list[list[np.ndarray]] = [[] for _ in parts]
    for call, out in zip(calls, outputs):
        out = np.asarray(out)
        rows[call.part].append(out.reshape(-1, out.shape[-1]))
    embeds = [np.concatenate(item_rows)[: part["tokens"]] for item_rows, part in zip(rows, parts)]
    embeds = np.ascontiguousarray(np.concatenate(embeds), dtype=np.float32)
    positions = np.asarray(positions, dtype=np.int32).reshape(-1)
    if embeds.shape[0] != positions.size:
        raise ValueError(f"encoders gave {embeds.shape[0]} embeddings for {positions.size} placeholders")
    return {T.PROMPT_EMBEDS: embeds, T.PROMPT_EMBED_POSITIONS: positions}


class EncoderModel(StageModel):
    """The Triton model of an encoder stage (dynamic batching); its model.py names the media `KIND`. Publishes
    the encoder's item and cache counters after each batch (ops/metrics.py EncoderMetrics)."""

    BATCHED = True
    KIND = ""

    def build(self, parameters: dict[str, str]) -> EncoderStage:
        self.NAME = ENCODERS[self.KIND][0]
        self.metrics = EncoderMetrics(self.pb_utils, self.args["model_name"], self.args["model_version"])
        return create_stage(self.KIND, parameters)

    def execute(self, requests) -> list:
        responses = super().execute(requests)
        self.metrics.publish(self.stage.num_items, self.stage.num_encoded)
        return responses
