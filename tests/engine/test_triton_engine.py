"""The engine with the Triton backend (the interpreter on a CPU) generates exactly the
same greedy tokens as with the torch reference backend."""

from microvllm import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, varied_prompts


def test_triton_backend_matches_torch_and_hf(tiny_models):
    folder = tiny_models["mistral"]  # sliding window + GQA: the kernel's hardest case here
    prompts = varied_prompts(512, count=6, seed=5, max_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(folder), attention_backend=backend, max_model_len=128,
                  max_num_batched_tokens=32, debug_invariants=True)
        outs[backend] = [o.outputs[0].token_ids for o in
                         llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert outs["triton"] == outs["torch"]
    for prompt, tokens in zip(prompts, outs["triton"]):
        assert tuple(tokens) == hf_greedy(str(folder), tuple(prompt), 12)
