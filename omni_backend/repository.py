"""Model repository settings and rendering.

The tracked `model_repository/<model>/config.pbtxt` files are templates: `${name}` placeholders are filled
from `Settings` (defaults, then `OMNI_<NAME>` environment variables, then explicit overrides). Rendering
copies every model folder (its `config.pbtxt` rendered, `1/model.py` and other files as they are) to an output
folder that tritonserver loads with `--model-repository`.

Every setting is declared once, where it is used (omni_backend/settings.py): the engine's in
`engine.config.EngineConfig`, the llm stage's in `stages.llm.parameters` (with the governor's, `governor_<field>`),
preprocess's in `stages.preprocess.PreprocessSettings`, the encoders' in `stages.media_encoder.EncoderSettings`
(`encoder_<field>`), the diffusion stage's in `stages.diffusion.DiffusionSettings` (`diffusion_<field>`) and the voice
stage's in `stages.talker.TalkerSettings` (`talker_<field>`) and `stages.code2wav.Code2WavSettings`
(`code2wav_<field>`); the front door's `serving.config.FrontDoorSettings` (`openai_<field>`) are in the table too,
read by the front door from the environment, not rendered. `Settings` is made from those declarations
(`SETTING_GROUPS`), the llm model's whole `parameters` block is rendered from them (`${llm_parameters}`), and the
table in docs/operations.md is `settings_table()` (`python -m omni_backend.repository --table` prints it).

Derived placeholders: `llm_instance_group`, the llm model's Triton instance group for `device` (KIND_CPU on CPU;
KIND_GPU on GPUs, so Triton runs one llm instance, each with its own engine, KV cache and governor, per GPU),
`llm_parameters`, and `voice_model` ("voice" when the llm's checkpoint has a talker, stages/voice.py). The `voice`
model itself is rendered only then (`served_models`). The GPU shares
(ops/gpu_budget.py) sum to 0.91 by default, leaving the rest for every process's CUDA context and Triton's memory
pools; a checkpoint with a talker adds `talker_gpu_memory_utilization` and code2wav's model.
"""

from __future__ import annotations

import argparse
import dataclasses
import filecmp
import os
import shutil
import re
from pathlib import Path

from omni_backend import paths
from omni_backend.serving.config import FrontDoorSettings
from omni_backend.settings import Spec, declared, operator_name, parse_text, to_text
from omni_backend.stages.diffusion import DiffusionSettings
from omni_backend.stages.llm.parameters import SETTING_GROUPS as LLM_SETTING_GROUPS
from omni_backend.stages.media_encoder import EncoderSettings
from omni_backend.stages.preprocess import PreprocessSettings
from omni_backend.stages.code2wav import Code2WavSettings
from omni_backend.stages.talker import TalkerSettings
from omni_backend.stages.voice import has_talker


_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
VOICE_MODEL = "voice"  # the model that speaks in the served checkpoint's own voice (stages/voice.py)


SETTING_GROUPS: tuple[tuple[type, str], ...] = (
    *LLM_SETTING_GROUPS, (PreprocessSettings, ""), (EncoderSettings, EncoderSettings.PREFIX),
    (DiffusionSettings, DiffusionSettings.PREFIX), (TalkerSettings, TalkerSettings.PREFIX),
    (Code2WavSettings, Code2WavSettings.PREFIX), (FrontDoorSettings, FrontDoorSettings.PREFIX))
"""Every operator setting: (declaring class, name prefix); the repository renders all but the front door's."""


def _declarations() -> dict[str, tuple[dataclasses.Field, Spec]]:
    """Operator name -> (field, spec) of every operator setting in `SETTING_GROUPS`."""
    return {operator_name(f, spec, prefix): (f, spec) for cls, prefix in SETTING_GROUPS
            for f, spec in declared(cls) if spec.operator}


def _default_llm_model_path() -> str:
    from omni_backend.setup.tiny_multimodal import VLM_NAME

    return str(paths.models_dir() / VLM_NAME)


def _default_diffusion_model_path() -> str:
    return str(paths.models_dir() / "tiny-sd-random")


class Settings:
    """Values substituted into the `config.pbtxt` templates: one attribute per operator setting of
    `SETTING_GROUPS`, named as operators name it (`llm_model_path` for the engine's `model_path`).

    Raises (constructor):
        ValueError: an unknown name, or a value its setting does not allow (strings are parsed with
            `settings.parse_text`).
    """

    def __init__(self, **values) -> None:
        declarations = _declarations()
        unknown = sorted(set(values) - set(declarations))
        if unknown:
            raise ValueError(f"unknown repository setting(s): {', '.join(unknown)}; known: {', '.join(declarations)}")
        values["llm_model_path"] = values.get("llm_model_path") or _default_llm_model_path()
        values["diffusion_model_path"] = values.get("diffusion_model_path") or _default_diffusion_model_path()
        for cls, prefix in SETTING_GROUPS:  # each group checks its own values and the rules between them
            given = {}
            for f, spec in declared(cls):
                name = operator_name(f, spec, prefix)
                if not spec.operator or name not in values:
                    continue
                value = values[name]
                if isinstance(value, str) and spec.kind is not str:
                    value = parse_text(value, spec, name)
                problem = spec.problem(value)
                if problem:
                    raise ValueError(f"setting {name} {problem}")
                given[f.name] = value
            group = cls(**given)
            for f, spec in declared(cls):
                if spec.operator:
                    setattr(self, operator_name(f, spec, prefix), getattr(group, f.name))
        self.llm_model_path = str(Path(self.llm_model_path).expanduser().absolute())
        self.diffusion_model_path = str(Path(self.diffusion_model_path).expanduser().absolute())

    def __repr__(self) -> str:
        return f"Settings({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    @classmethod
    def load(cls, overrides: dict | None = None, environ: dict | None = None) -> "Settings":
        """Defaults, then `OMNI_<NAME>` environment variables, then `overrides`.

        Raises:
            ValueError: an unknown setting name in `overrides`, or a value of the wrong kind.
        """
        environ = os.environ if environ is None else environ
        values = {name: environ[f"OMNI_{name.upper()}"] for name in _declarations()
                  if environ.get(f"OMNI_{name.upper()}")}
        values.update(overrides or {})
        return cls(**values)

    def as_strings(self) -> dict[str, str]:
        """Placeholder name -> text substituted into templates (`settings.to_text`), with the derived
        `llm_instance_group`, `llm_parameters` and `voice_model` (the voice stage's name when the served checkpoint
        has a talker, else "": its spoken answers then come from the tts stage)."""
        values = {name: to_text(value) for name, value in vars(self).items()}
        values["llm_instance_group"] = llm_instance_group(self.device, tensor_parallel_size=self.tensor_parallel_size)
        values["llm_parameters"] = self.llm_parameters()
        values["voice_model"] = VOICE_MODEL if has_talker(self.llm_model_path) else ""
        return values

    def llm_parameter_values(self) -> dict[str, str]:
        """The llm model's parameters as `stages.llm.parameters.parse_parameters` reads them: every operator
        setting of `stages.llm.parameters.SETTING_GROUPS` under its key (field name, prefixed), as text; settings
        only code sets keep their defaults (absent)."""
        return {f"{prefix}{f.name}": to_text(getattr(self, operator_name(f, spec, prefix)))
                for cls, prefix in LLM_SETTING_GROUPS for f, spec in declared(cls) if spec.operator}

    def llm_parameters(self) -> str:
        """The llm model's `parameters` block (`llm_parameter_values`), one line each."""
        lines = []
        for key, value in self.llm_parameter_values().items():
            escaped = value.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{escaped}" }} }}')
        return "\n".join(lines)


def settings_table() -> str:
    """docs/operations.md's table of the repository settings: environment variable, default, what it is."""
    defaults = Settings.load(environ={})
    cache = str(paths.cache_dir())
    rows = ["| environment | default | allowed | |", "| --- | --- | --- | --- |"]
    for name, (_, spec) in _declarations().items():
        default = to_text(getattr(defaults, name)).replace(cache, ".cache")
        rows.append(f"| `OMNI_{name.upper()}` | {f'`{default}`' if default else '(empty)'} | {spec.allowed()} | "
                    f"{spec.doc} |")
    return "\n".join(rows)


def _torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def llm_instance_group(device: str, cuda_available=_torch_cuda_available, tensor_parallel_size: int = 1) -> str:
    """The llm model's Triton instance group for the `device` setting.

    KIND_GPU on GPUs: Triton then starts one instance (stub process) per listed GPU and tells each its GPU
    (`args["model_instance_device_id"]`), so every GPU gets its own engine, KV cache and governor: data parallel
    inside one tritonserver, with Triton spreading requests over the instances. "cuda" lists every GPU, "cuda:N"
    only GPU N; "auto" is "cuda" when torch can use CUDA (`cuda_available`, asked only for "auto"). With
    `tensor_parallel_size` > 1 on GPUs, one KIND_MODEL instance: its engine is rank 0 on the `device` setting's GPU
    (cuda: the first) and spawns the other ranks on the next GPUs (engine/tp_ranks.py).

    Raises:
        ValueError: not auto, cpu, cuda or cuda:N.
    """
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cpu":
        return "{ count: 1 kind: KIND_CPU }"
    if tensor_parallel_size > 1:
        return "{ count: 1 kind: KIND_MODEL }"
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


def served_models(settings: Settings, templates: Path | None = None) -> list[str]:
    """The models a server with `settings` runs unless told otherwise: every template's, but `voice` only when the
    llm's checkpoint has a talker (stages/voice.py `has_talker`); without one it would load nothing and still cost
    a Python-backend stub process that answers every request UNAVAILABLE."""
    return [name for name in model_names(templates)
            if name != VOICE_MODEL or has_talker(settings.llm_model_path)]


def render_config(template: str, settings: Settings, source: str = "config.pbtxt") -> str:
    """Fill the `${name}` placeholders of one config template.

    Only `${identifier}` is a placeholder; any other `$` text (e.g. "${...}" in a comment) is left alone.
    Values are escaped for protobuf text string literals (backslash and double quote).

    Raises:
        ValueError: the template names a placeholder that is not a setting (message names file and key).
    """
    values = settings.as_strings()
    escaped = {k: v.replace("\\", "\\\\").replace('"', '\\"') for k, v in values.items()}
    escaped["llm_parameters"] = values["llm_parameters"]  # lines of protobuf text, escaped inside

    def substitute(match: re.Match) -> str:
        name = match.group(1)
        if name not in escaped:
            raise ValueError(f"{source}: unknown placeholder ${{{name}}}; settings: {', '.join(values)}")
        return escaped[name]

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
        models: subset of model names; default `served_models` (every model in `templates`, `voice` only for a
            checkpoint with a talker).
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
    models = served_models(settings, templates) if models is None else list(models)
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Print the repository settings table of docs/operations.md.")
    parser.add_argument("--table", action="store_true", required=True)
    parser.parse_args()
    print(settings_table())
