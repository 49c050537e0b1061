"""The default backend on a CPU ("auto" -> the C++ decode kernel) generates exactly the
same greedy tokens as the torch backend and as Hugging Face transformers."""

import pytest

from microvllm.platforms.cpu import attention as cpu_kernels
from tests.engine.conftest import greedy_by_backend, hf_greedy, varied_prompts


@pytest.mark.skipif(cpu_kernels.kernel_status() is not None, reason="CPU kernel unavailable")
@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: sliding window + GQA
def test_auto_backend_is_the_cpu_kernel_and_matches_torch_and_hf(tiny_models, family):
    folder = tiny_models[family]
    prompts = varied_prompts(512, count=6, seed=7, max_len=40)
    outs = greedy_by_backend(folder, prompts, ("auto", "torch"))
    assert outs["auto"][0] == "cpu" and outs["torch"][0] == "torch"
    assert outs["auto"][1] == outs["torch"][1]
    for prompt, tokens in zip(prompts, outs["auto"][1]):
        assert tuple(tokens) == hf_greedy(str(folder), tuple(prompt), 12)
