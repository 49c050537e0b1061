"""Shared test setup.

Triton's interpreter must be switched on before triton is first imported, so this
happens here, before any test module imports microvllm's Triton backend.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model_folder():
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (converted once)."""
    from microvllm.models.default_model import default_model_path

    return default_model_path()
