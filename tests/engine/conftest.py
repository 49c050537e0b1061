"""Fixtures for engine tests: tiny models written once per session, and Hugging Face
reference outputs computed once per (model, prompt)."""

import functools

import pytest
import torch

from microvllm.models.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    archs = ("llama", "mistral", "qwen3", "qwen3_moe", "mixtral", "qwen3_5")
    return {arch: make_tiny_model(root / arch, arch, seed=7) for arch in archs}


@functools.lru_cache(maxsize=None)
def hf_model(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def hf_greedy(folder, prompt_ids: tuple, max_new_tokens: int) -> tuple:
    """Hugging Face ``generate`` on one prompt alone, greedy, no early stop."""
    model = hf_model(str(folder))
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=0, eos_token_id=None)
    return tuple(out[0, len(prompt_ids):].tolist())


def greedy_by_backend(folder, prompts, backends, max_tokens: int = 12, **settings) -> dict:
    """Greedy token ids for ``prompts`` from one engine per attention backend (same settings
    otherwise), and the backend name each engine resolved to: ``{name: (resolved, ids)}``."""
    from microvllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = {}
    for backend in backends:
        llm = LLM(str(folder), attention_backend=backend, max_model_len=128,
                  max_num_batched_tokens=32, debug_invariants=True, **settings)
        ids = [o.outputs[0].token_ids for o in
               llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        outs[backend] = (llm.engine.config.device_config.attention_backend, ids)
    return outs


def varied_prompts(vocab: int, count: int = 16, seed: int = 0, max_len: int = 60) -> list[list[int]]:
    """``count`` prompts of varied lengths; half share a 21-token prefix (ends mid-block
    for block size 16), and two are identical."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (21,), generator=g).tolist()
    prompts = []
    for i in range(count):
        length = int(torch.randint(1, max_len, (1,), generator=g))
        tail = torch.randint(3, vocab, (length,), generator=g).tolist()
        prompts.append(shared + tail[: max(1, length // 2)] if i % 2 else tail)
    prompts.append(list(prompts[1]))
    return prompts
