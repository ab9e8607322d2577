"""Kernel tests run on CUDA when present, else through the Triton interpreter on CPU.

TRITON_INTERPRET must be set before ``triton`` is first imported (``@triton.jit`` picks the
interpreter at decoration time), so this file sets it at import, ahead of the test modules.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
