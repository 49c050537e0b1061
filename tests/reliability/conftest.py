"""Fixtures for the reliability tests: tiny models written once per session, one thread.

Each engine step of a tiny model is a few small matrix products. On a shared
2-core machine torch's default of one thread per core makes every such product
wait for a busy core (measured: ~100 ms a step instead of ~4 ms), so these tests
run torch on one thread and restore the setting afterwards.
"""

import pytest
import torch

from microvllm.models.tiny import make_tiny_model


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    """One-layer Llama (full attention) and Mistral (sliding window 8), with tokenizers."""
    root = tmp_path_factory.mktemp("reliability_models")
    return {arch: make_tiny_model(root / arch, arch, seed=7, num_hidden_layers=1)
            for arch in ("llama", "mistral")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_folders):
    return tiny_folders["llama"]
