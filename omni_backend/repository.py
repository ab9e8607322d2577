"""Model repository settings and rendering.

The tracked `model_repository/<model>/config.pbtxt` files are templates: `${name}` placeholders are filled
from `Settings` (defaults below, then `OMNI_<NAME>` environment variables, then explicit overrides). Rendering
copies every model folder (its `config.pbtxt` rendered, `1/model.py` and other files as they are) to an output
folder that tritonserver loads with `--model-repository`.

Settings (placeholder name, environment variable, default):

    llm_model_path     OMNI_LLM_MODEL_PATH     <cache>/models/SmolLM2-135M-Instruct (absolute)
    max_model_len      OMNI_MAX_MODEL_LEN      2048 tokens (prompt + completion)
    max_num_seqs       OMNI_MAX_NUM_SEQS       32 sequences decoded together
    kv_cache_bytes     OMNI_KV_CACHE_BYTES     536870912 (512 MiB)
    block_size         OMNI_BLOCK_SIZE         16 tokens per KV-cache block
    max_num_batched_tokens OMNI_MAX_NUM_BATCHED_TOKENS 1024 tokens per engine step (prefill chunks + decodes)
    max_queued_requests OMNI_MAX_QUEUED_REQUESTS 256 requests waiting at the llm stage beyond max_num_seqs
                                               (more are refused: UNAVAILABLE; 0: no limit)
    device             OMNI_DEVICE             auto (cuda when available, else cpu)
    dtype              OMNI_DTYPE              auto
    attention_backend  OMNI_ATTENTION_BACKEND  auto
    diffusion_model_path OMNI_DIFFUSION_MODEL_PATH <cache>/models/tiny-sd-random (diffusers pipeline folder)
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
    return str(paths.models_dir() / "SmolLM2-135M-Instruct")


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
        device: "auto", "cpu" or "cuda[:n]" for the llm stage.
        dtype: weight/activation dtype ("auto", "float32", "float16", "bfloat16").
        attention_backend: "auto", "cpu", "torch" or "triton".
        diffusion_model_path: absolute path of the diffusion stage's diffusers pipeline folder.
    """

    llm_model_path: str = ""
    max_model_len: int = 2048
    max_num_seqs: int = 32
    kv_cache_bytes: int = 512 * 1024 * 1024
    block_size: int = 16
    max_num_batched_tokens: int = 1024
    max_queued_requests: int = 256
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    diffusion_model_path: str = ""

    def __post_init__(self) -> None:
        if not self.llm_model_path:
            self.llm_model_path = _default_llm_model_path()
        self.llm_model_path = str(Path(self.llm_model_path).expanduser().absolute())
        if not self.diffusion_model_path:
            self.diffusion_model_path = _default_diffusion_model_path()
        self.diffusion_model_path = str(Path(self.diffusion_model_path).expanduser().absolute())
        positive = ("max_model_len", "max_num_seqs", "kv_cache_bytes", "block_size", "max_num_batched_tokens")
        for name in positive + ("max_queued_requests",):
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
        """Placeholder name -> text substituted into templates."""
        return {name: str(value) for name, value in asdict(self).items()}


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
