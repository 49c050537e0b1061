"""The engine with the Triton backend (the interpreter on a CPU) generates exactly the
same greedy tokens as with the torch reference backend."""

import pytest

from tests.engine.conftest import greedy_by_backend, hf_greedy, varied_prompts


@pytest.mark.slow   # about 13 s in Triton's interpreter; the kernels' own tests stay in the quick tier
def test_triton_backend_matches_torch_and_hf(tiny_models):
    folder = tiny_models["mistral"]  # sliding window + GQA: the kernel's hardest case here
    prompts = varied_prompts(512, count=6, seed=5, max_len=30)
    outs = {name: ids for name, (_, ids) in greedy_by_backend(folder, prompts, ("torch", "triton")).items()}
    assert outs["triton"] == outs["torch"]
    for prompt, tokens in zip(prompts, outs["triton"]):
        assert tuple(tokens) == hf_greedy(str(folder), tuple(prompt), 12)
