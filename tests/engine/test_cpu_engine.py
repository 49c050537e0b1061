"""The default backend on a CPU ("auto" -> the C++ decode kernel) generates exactly the
same greedy tokens as the torch backend and as Hugging Face transformers."""

import pytest

from microvllm import LLM, SamplingParams
from microvllm.attention import cpu_kernels
from tests.engine.conftest import hf_greedy, varied_prompts


@pytest.mark.skipif(cpu_kernels.kernel_status() is not None, reason="CPU kernel unavailable")
@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: sliding window + GQA
def test_auto_backend_is_the_cpu_kernel_and_matches_torch_and_hf(tiny_models, family):
    folder = tiny_models[family]
    prompts = varied_prompts(512, count=6, seed=7, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("auto", "torch"):
        llm = LLM(str(folder), attention_backend=backend, max_model_len=128,
                  max_num_batched_tokens=32, debug_invariants=True)
        assert llm.engine.config.attention_backend == ("cpu" if backend == "auto" else "torch")
        outs[backend] = [o.outputs[0].token_ids for o in
                         llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert outs["auto"] == outs["torch"]
    for prompt, tokens in zip(prompts, outs["auto"]):
        assert tuple(tokens) == hf_greedy(str(folder), tuple(prompt), 12)
