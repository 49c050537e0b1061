"""Our model vs Hugging Face transformers on the same weights.

Tolerances (float32): logits within 1e-4 absolute (scaled by the logits' magnitude)
of Hugging Face's; the argmax identical at every position; greedy decoding through a
paged KV cache with scattered blocks identical to ``generate`` for 40 new tokens.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from microvllm.attention import get_attention_backend
from microvllm.models.loader import load_model
from microvllm.models.tiny import make_tiny_model
from tests.models.paged_driver import greedy_paged

NEW_TOKENS = 40
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen3", "qwen3_5"])
def tiny_folder(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=1,
                           tokenizer=False)


def prompt(vocab, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def hf_greedy(hf, ids, n):
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def check_parity(folder, ids, block_size=16):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours, _ = load_model(folder, get_attention_backend("torch"))
    with torch.no_grad():
        hf_logits = hf(torch.tensor([ids])).logits[0]
    our_logits, our_new = greedy_paged(ours, ids, NEW_TOKENS, block_size=block_size)
    scale = hf_logits.abs().max().item()
    assert torch.allclose(our_logits, hf_logits, atol=LOGIT_ATOL * max(1.0, scale), rtol=0), \
        f"max logit difference {(our_logits - hf_logits).abs().max():.3g}"
    assert torch.equal(our_logits.argmax(-1), hf_logits.argmax(-1))
    assert our_new == hf_greedy(hf, ids, NEW_TOKENS)


def test_tiny_models_match_hf(tiny_folder):
    # 37 tokens: longer than Mistral's window of 8, and ends mid-block.
    check_parity(tiny_folder, prompt(512, 37, seed=3))


def test_tiny_llama_block_size_1(tmp_path):
    folder = make_tiny_model(tmp_path, "llama", seed=2, tokenizer=False)
    check_parity(folder, prompt(512, 20, seed=4), block_size=1)


def test_tiny_hybrid_layers_match_hf(tmp_path):
    """A Qwen3 with alternating full / sliding-window layers: two cache groups."""
    folder = make_tiny_model(tmp_path, "qwen3", seed=5, tokenizer=False, num_hidden_layers=4,
                             use_sliding_window=True, sliding_window=6, max_window_layers=0,
                             layer_types=["full_attention", "sliding_attention"] * 2)
    ours, _ = load_model(folder, get_attention_backend("torch"))
    assert ours.layout.num_groups == 2
    check_parity(folder, prompt(512, 30, seed=6))


def test_default_model_matches_hf(default_model_folder):
    ids = [1, 504, 3458, 282, 4649, 314, 253, 3575, 30, 2, 198]  # any ids: we compare models
    check_parity(default_model_folder, ids)
