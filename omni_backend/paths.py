"""Where the project keeps its generated files.

Everything generated at setup (tritonserver runtime folder, converted model checkpoints, the rendered model
repository) lives under one cache folder, `<project>/.cache` unless `OMNI_CACHE_DIR` says otherwise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The repository checkout this package is installed from (editable install)."""

MODEL_REPOSITORY_TEMPLATES = PROJECT_ROOT / "model_repository"
"""Tracked stage models; their `config.pbtxt` files are templates with `${name}` placeholders."""


def cache_dir() -> Path:
    """Absolute cache folder: `$OMNI_CACHE_DIR` or `<project>/.cache`."""
    return Path(os.environ.get("OMNI_CACHE_DIR") or PROJECT_ROOT / ".cache").absolute()


def models_dir() -> Path:
    """Folder of converted model checkpoints (`<cache>/models`)."""
    return cache_dir() / "models"


def runtime_dir() -> Path:
    """The tritonserver runtime folder laid out at setup (`<cache>/tritonserver`)."""
    return cache_dir() / "tritonserver"


def rendered_repository_dir() -> Path:
    """The model repository rendered with the default settings (`<cache>/model_repository`)."""
    return cache_dir() / "model_repository"


def venv_bin() -> Path:
    """The running interpreter's environment `bin/` folder (the project venv when run from it).

    Not resolved through symlinks: a venv's `python` links to the base interpreter, and the stub processes
    must find the venv's `python3` (whose `sys.path` has the project's packages) first on `PATH`.
    """
    return Path(sys.prefix) / "bin"
