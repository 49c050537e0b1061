"""Shared test setup.

Triton's interpreter must be switched on before triton is first imported, so this
happens here, before any test module imports microvllm's Triton backend.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
