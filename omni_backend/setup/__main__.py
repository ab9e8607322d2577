"""`python -m omni_backend.setup`: lay out the tritonserver runtime, convert the model, render the repository.

Silent when nothing changed (fast: no heavy imports unless a model must be converted). Environment overrides
for the rendered settings are described in `omni_backend.repository`.
"""

from __future__ import annotations

import argparse
import sys

from omni_backend import paths, repository
from omni_backend.setup import runtime, smollm2, tiny_multimodal


def main(argv: list[str] | None = None) -> int:
    """Run every setup step; returns the process exit code (1 with a message on a setup error)."""
    parser = argparse.ArgumentParser(prog="python -m omni_backend.setup", description=__doc__)
    parser.add_argument("--skip-model", action="store_true", help="do not convert the LLM checkpoint")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress lines show up as they happen
    try:
        runtime.ensure_runtime()
        if not args.skip_model:
            smollm2.ensure_checkpoint()
            tiny_multimodal.ensure_encoders()
        output = paths.rendered_repository_dir()
        if repository.render_repository(output):
            print(f"[setup] rendered model repository {output}")
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"[setup] error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
