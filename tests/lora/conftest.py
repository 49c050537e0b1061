"""Tiny models with peft adapters made offline, and Hugging Face + peft's greedy answers."""

from __future__ import annotations

import functools

import pytest
import torch

from microvllm.lora.request import LoRARequest
from microvllm.models.tiny import make_tiny_model

# Different ranks, alphas and targets; one rsLoRA; one leaves the attention alone.
ADAPTER_CONFIGS = {
    "sql": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "poem": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
    "math": dict(r=2, lora_alpha=8, target_modules=["v_proj", "up_proj", "o_proj"]),
}


def make_adapter(model_folder, adapter_folder, seed: int, **lora_kwargs):
    """A peft adapter of random A and B (``init_lora_weights=False``: B is not zero, so the
    adapter changes the output), saved as peft saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_folder), dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    model.save_pretrained(str(adapter_folder))
    return adapter_folder


@pytest.fixture(scope="session")
def lora_models(tmp_path_factory):
    """``{arch: (model folder, {name: LoRARequest})}`` for tiny llama and qwen3."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora_models")
    out = {}
    for arch in ("llama", "qwen3"):
        folder = make_tiny_model(root / arch, arch, seed=7)
        requests = {name: LoRARequest(name, i + 1, str(make_adapter(folder, root / f"{arch}_{name}", seed=i + 1,
                                                                    **kwargs)))
                    for i, (name, kwargs) in enumerate(ADAPTER_CONFIGS.items())}
        out[arch] = (folder, requests)
    return out


@functools.lru_cache(maxsize=None)
def _hf_model(folder: str, adapter: str | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


@functools.lru_cache(maxsize=None)
def hf_peft_greedy(folder: str, adapter: str | None, prompt_ids: tuple, max_new_tokens: int) -> tuple:
    """transformers + peft ``generate`` on one prompt alone, greedy, no early stop
    (``adapter`` None: the base model)."""
    model = _hf_model(folder, adapter)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=0, eos_token_id=None)
    return tuple(out[0, len(prompt_ids):].tolist())
