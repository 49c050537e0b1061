"""Tokenizers shared by the tokenizer-path tests, each loaded once per session."""

import pytest

from microvllm.models.default_model import default_model_path
from microvllm.models.tiny_tokenizer import build_tiny_tokenizer
from microvllm.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smol_path():
    """The SmolLM2-135M-Instruct folder (a byte-level BPE with 49,152 tokens)."""
    return default_model_path()


@pytest.fixture(scope="session")
def smol_tokenizer(smol_path):
    return Tokenizer.from_pretrained(smol_path)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path):
    return Tokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="session", params=["smol", "tiny"])
def any_tokenizer(request):
    """Both tokenizers in turn: the real one, and the tiny one that splits almost
    every non-ASCII character into byte tokens."""
    return request.getfixturevalue(f"{request.param}_tokenizer")
