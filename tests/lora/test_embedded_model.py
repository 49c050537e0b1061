"""LoRA on the embedded SmolLM2-135M-Instruct (a real model, fp32): a peft-made adapter on
every projection, greedy tokens identical to transformers + peft, in one batch with the
base model's requests."""

from __future__ import annotations

import pytest

from microvllm import LLM, SamplingParams
from microvllm.lora.request import LoRARequest
from microvllm.tokenizer import Tokenizer
from tests.lora.conftest import hf_peft_greedy, make_adapter

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 8


@pytest.mark.slow   # the 135M model in transformers and in the engine: about 20 s on 2 cores
def test_a_peft_adapter_on_the_embedded_model_equals_peft(default_model_folder, tmp_path):
    pytest.importorskip("peft")
    adapter = make_adapter(default_model_folder, tmp_path / "adapter", seed=0, r=8, lora_alpha=16,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"])
    lora = LoRARequest("smol", 1, str(adapter))
    tokenizer = Tokenizer.from_pretrained(default_model_folder)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    llm = LLM(str(default_model_folder), enable_lora=True, max_lora_rank=8, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ids] * 2
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=[lora, lora, None, None])
    got = [tuple(o.outputs[0].token_ids) for o in outs]
    with_adapter = [hf_peft_greedy(str(default_model_folder), str(adapter), tuple(p), MAX_TOKENS) for p in ids]
    base = [hf_peft_greedy(str(default_model_folder), None, tuple(p), MAX_TOKENS) for p in ids]
    assert got == with_adapter + base
    assert with_adapter != base, "the adapter should change the answer"
