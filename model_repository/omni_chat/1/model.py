"""Triton glue for a streaming entry point; the pipeline is omni_backend/stages/entry_points.py."""

import triton_python_backend_utils as pb_utils

from omni_backend.stages.bls import EntryPointModel


class TritonPythonModel(EntryPointModel):
    def __init__(self):
        super().__init__(pb_utils)
