"""Model repository settings and rendering.

The tracked `model_repository/<model>/config.pbtxt` files are templates: `${name}` placeholders are filled
from `Settings` (defaults below, then `OMNI_<NAME>` environment variables, then explicit overrides). Rendering
copies every model folder (its `config.pbtxt` rendered, `1/model.py` and other files as they are) to an output
folder that tritonserver loads with `--model-repository`.

Settings (placeholder name, environment variable, default):

    llm_model_path     OMNI_LLM_MODEL_PATH     <cache>/models/SmolVLM-SmolLM2-135M-Instruct (absolute): SmolLM2 in a
                                               SmolVLM-architecture folder (setup/tiny_multimodal.py)
    max_model_len      OMNI_MAX_MODEL_LEN      2048 tokens (prompt + completion)
    max_num_seqs       OMNI_MAX_NUM_SEQS       32 sequences decoded together
    kv_cache_bytes     OMNI_KV_CACHE_BYTES     0: the device's default (512 MiB on CPU; on a GPU what
                                               gpu_memory_utilization leaves); else bytes, on CPU and GPU
    block_size         OMNI_BLOCK_SIZE         16 tokens per KV-cache block
    max_num_batched_tokens OMNI_MAX_NUM_BATCHED_TOKENS 1024 tokens per engine step (prefill chunks + decodes)
    max_queued_requests OMNI_MAX_QUEUED_REQUESTS 256 requests waiting at the llm stage beyond max_num_seqs
                                               (more are refused: UNAVAILABLE; 0: no limit)
    device             OMNI_DEVICE             auto (cuda when torch can use it, else cpu); cuda: one llm engine
                                               per GPU (a KIND_GPU instance group); cuda:N: GPU N only
    dtype              OMNI_DTYPE              auto
    attention_backend  OMNI_ATTENTION_BACKEND  auto
    enforce_eager      OMNI_ENFORCE_EAGER      false (true: never capture CUDA graphs)
    enable_prefix_caching OMNI_ENABLE_PREFIX_CACHING true (false: every request prefills its whole prompt)
    cpu_threads        OMNI_CPU_THREADS        0: a CPU llm engine's torch threads are the usable cores - 1 (at
                                               least 1), a core left for tritonserver and the front door
    quantization       OMNI_QUANTIZATION       none; int8: weight-only int8 projections and output head, one
                                               float32 scale per output channel (CPU engines, float32)
    gpu_memory_utilization OMNI_GPU_MEMORY_UTILIZATION 0.75 of each GPU for its llm engine (weights,
                                               activations, CUDA graphs, KV cache)
    encoder_gpu_memory_fraction OMNI_ENCODER_GPU_MEMORY_FRACTION 0.04 of the GPU for each media encoder
    diffusion_gpu_memory_fraction OMNI_DIFFUSION_GPU_MEMORY_FRACTION 0.08 of the GPU for the diffusion stage
    diffusion_model_path OMNI_DIFFUSION_MODEL_PATH <cache>/models/tiny-sd-random (diffusers pipeline folder)
    completions_allow_special_tokens OMNI_COMPLETIONS_ALLOW_SPECIAL_TOKENS false (true: control-token strings in
                                               a plain-text prompt, e.g. "<|im_end|>", become those tokens;
                                               chat messages are text whatever it says)

Derived placeholder: `llm_instance_group`, the llm model's Triton instance group for `device` (KIND_CPU on CPU;
KIND_GPU on GPUs, so Triton runs one llm instance, each with its own engine, KV cache and governor, per GPU).
The GPU shares (ops/gpu_budget.py) sum to 0.91 by default, leaving the rest for every process's CUDA context and
Triton's memory pools.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from omni_backend import paths


_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _default_llm_model_path() -> str:
    from omni_backend.setup.tiny_multimodal import VLM_NAME

    return str(paths.models_dir() / VLM_NAME)


def _default_diffusion_model_path() -> str:
    return str(paths.models_dir() / "tiny-sd-random")


@dataclass
class Settings:
    """Values substituted into the `config.pbtxt` templates (all rendered as strings).

    Attributes:
        llm_model_path: absolute path of the LLM checkpoint (HF layout: config, safetensors, tokenizer).
        max_model_len: longest sequence, prompt plus completion, in tokens.
        max_num_seqs: most sequences the engine decodes at once.
        kv_cache_bytes: bytes reserved for the paged KV cache.
        block_size: tokens per KV-cache block.
        max_num_batched_tokens: per-step token budget of the engine (prefill chunks + decodes).
        max_queued_requests: requests the llm stage holds beyond `max_num_seqs` (waiting to run); a request
            beyond that is refused at once with UNAVAILABLE "waiting queue is full" (0: no limit).
        device: "auto", "cpu", "cuda" (every GPU, one llm engine each) or "cuda:N".
        dtype: weight/activation dtype ("auto", "float32", "float16", "bfloat16").
        attention_backend: "auto", "cpu", "torch" or "triton".
        enforce_eager: never capture CUDA graphs.
        enable_prefix_caching: reuse the KV blocks of prompt prefixes already computed (engine/prefix_cache.py).
        cpu_threads: torch threads of a CPU llm engine (0: usable cores - 1, at least 1).
        quantization: "none" or "int8" (weight-only, per output channel; CPU engines computing in float32).
        gpu_memory_utilization: share of each GPU's memory its llm engine may use, in (0, 1].
        encoder_gpu_memory_fraction, diffusion_gpu_memory_fraction: the other GPU stages' shares, in (0, 1].
        diffusion_model_path: absolute path of the diffusion stage's diffusers pipeline folder.
        completions_allow_special_tokens: preprocess tokenizes a plain-text prompt (completions' `prompt`, a
            `text_input` that is no messages array) with its control-token strings as tokens; off, they are text.
    """

    llm_model_path: str = ""
    max_model_len: int = 2048
    max_num_seqs: int = 32
    kv_cache_bytes: int = 0
    block_size: int = 16
    max_num_batched_tokens: int = 1024
    max_queued_requests: int = 256
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    cpu_threads: int = 0
    quantization: str = "none"
    gpu_memory_utilization: float = 0.75
    encoder_gpu_memory_fraction: float = 0.04
    diffusion_gpu_memory_fraction: float = 0.08
    diffusion_model_path: str = ""
    completions_allow_special_tokens: bool = False

    def __post_init__(self) -> None:
        if not self.llm_model_path:
            self.llm_model_path = _default_llm_model_path()
        self.llm_model_path = str(Path(self.llm_model_path).expanduser().absolute())
        if not self.diffusion_model_path:
            self.diffusion_model_path = _default_diffusion_model_path()
        self.diffusion_model_path = str(Path(self.diffusion_model_path).expanduser().absolute())
        positive = ("max_model_len", "max_num_seqs", "block_size", "max_num_batched_tokens")
        for name in positive + ("max_queued_requests", "kv_cache_bytes", "cpu_threads"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = int(value)
                except ValueError:
                    raise ValueError(f"setting {name} must be an integer, got {value!r}") from None
            low = 1 if name in positive else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "a positive integer" if low else "an integer >= 0"
                raise ValueError(f"setting {name} must be {kind}, got {value!r}")
            setattr(self, name, value)
        for name in ("gpu_memory_utilization", "encoder_gpu_memory_fraction", "diffusion_gpu_memory_fraction"):
            value = getattr(self, name)
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"setting {name} must be a number in (0, 1], got {value!r}") from None
            if isinstance(getattr(self, name), bool) or not 0.0 < value <= 1.0:
                raise ValueError(f"setting {name} must be a number in (0, 1], got {getattr(self, name)!r}")
            setattr(self, name, value)
        for name in ("enforce_eager", "enable_prefix_caching", "completions_allow_special_tokens"):
            value = getattr(self, name)
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                value = value.lower() in ("true", "1")
            if not isinstance(value, bool):
                raise ValueError(f"setting {name} must be true or false, got {value!r}")
            setattr(self, name, value)
        llm_instance_group(self.device, cuda_available=lambda: False)  # validates the device's form

    @classmethod
    def load(cls, overrides: dict | None = None, environ: dict | None = None) -> "Settings":
        """Defaults, then `OMNI_<NAME>` environment variables, then `overrides`.

        Raises:
            ValueError: an unknown setting name in `overrides`, or a value of the wrong kind.
        """
        environ = os.environ if environ is None else environ
        known = [f.name for f in fields(cls)]
        values = {name: environ[f"OMNI_{name.upper()}"] for name in known if environ.get(f"OMNI_{name.upper()}")}
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise ValueError(f"unknown repository setting(s): {', '.join(unknown)}; known: {', '.join(known)}")
        values.update(overrides)
        return cls(**values)

    def as_strings(self) -> dict[str, str]:
        """Placeholder name -> text substituted into templates (booleans as "true"/"false"), with the derived
        `llm_instance_group`."""
        values = {name: str(value).lower() if isinstance(value, bool) else str(value)
                  for name, value in asdict(self).items()}
        values["llm_instance_group"] = llm_instance_group(self.device)
        return values


def _torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def llm_instance_group(device: str, cuda_available=_torch_cuda_available) -> str:
    """The llm model's Triton instance group for the `device` setting.

    KIND_GPU on GPUs: Triton then starts one instance (stub process) per listed GPU and tells each its GPU
    (`args["model_instance_device_id"]`), so every GPU gets its own engine, KV cache and governor: data parallel
    inside one tritonserver, with Triton spreading requests over the instances. "cuda" lists every GPU, "cuda:N"
    only GPU N; "auto" is "cuda" when torch can use CUDA (`cuda_available`, asked only for "auto").

    Raises:
        ValueError: not auto, cpu, cuda or cuda:N.
    """
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cpu":
        return "{ count: 1 kind: KIND_CPU }"
    if device == "cuda":
        return "{ count: 1 kind: KIND_GPU }"
    index = device.removeprefix("cuda:")
    if device.startswith("cuda:") and index.isdigit():
        return f"{{ count: 1 kind: KIND_GPU gpus: [ {int(index)} ] }}"
    raise ValueError(f"setting device must be auto, cpu, cuda or cuda:N, got {device!r}")


def model_names(templates: Path | None = None) -> list[str]:
    """Names of the models in the template repository (folders with a `config.pbtxt`), sorted."""
    templates = templates or paths.MODEL_REPOSITORY_TEMPLATES
    return sorted(p.parent.name for p in templates.glob("*/config.pbtxt"))


def render_config(template: str, settings: Settings, source: str = "config.pbtxt") -> str:
    """Fill the `${name}` placeholders of one config template.

    Only `${identifier}` is a placeholder; any other `$` text (e.g. "${...}" in a comment) is left alone.
    Values are escaped for protobuf text string literals (backslash and double quote).

    Raises:
        ValueError: the template names a placeholder that is not a setting (message names file and key).
    """
    values = {k: v.replace("\\", "\\\\").replace('"', '\\"') for k, v in settings.as_strings().items()}

    def substitute(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise ValueError(f"{source}: unknown placeholder ${{{name}}}; settings: {', '.join(values)}")
        return values[name]

    return _PLACEHOLDER.sub(substitute, template)


def render_repository(
    output: Path,
    settings: Settings | None = None,
    models: list[str] | None = None,
    templates: Path | None = None,
    **overrides,
) -> bool:
    """Render the template repository (or the listed `models`) into `output`.

    The output is built next to `output` and swapped in only when its content differs, so a repeated call
    with the same settings leaves files (and their times) alone. Every model gets a version folder `1/`
    (ensembles need an empty one).

    Args:
        output: folder to (re)create; anything else in it is replaced.
        settings: values to use; default `Settings.load(overrides)`.
        models: subset of model names; default every model in `templates`.
        templates: template repository, default `<project>/model_repository`.
        **overrides: setting overrides when `settings` is not given (e.g. `kv_cache_bytes=64 << 20`).

    Returns:
        True when `output` changed.

    Raises:
        ValueError: unknown model name, unknown setting or placeholder.
    """
    templates = templates or paths.MODEL_REPOSITORY_TEMPLATES
    if settings is None:
        settings = Settings.load(overrides)
    elif overrides:
        raise ValueError("pass either settings or overrides, not both")
    available = model_names(templates)
    models = available if models is None else list(models)
    missing = sorted(set(models) - set(available))
    if missing:
        raise ValueError(f"no such model(s) in {templates}: {', '.join(missing)}")

    output = Path(output).absolute()
    staging = output.with_name(output.name + ".rendering")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in models:
        source, target = templates / name, staging / name
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".gitkeep"))
        config = source / "config.pbtxt"
        (target / "config.pbtxt").write_text(render_config(config.read_text(), settings, str(config)))
        (target / "1").mkdir(exist_ok=True)

    if output.is_dir() and _same_tree(staging, output):
        shutil.rmtree(staging)
        return False
    shutil.rmtree(output, ignore_errors=True)
    staging.rename(output)
    return True


def _same_tree(a: Path, b: Path) -> bool:
    comparison = filecmp.dircmp(a, b, ignore=["__pycache__"])
    if comparison.left_only or comparison.right_only or comparison.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, comparison.common_files, shallow=False)
    if mismatch or errors:
        return False
    return all(_same_tree(a / d, b / d) for d in comparison.common_dirs)
