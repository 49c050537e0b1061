"""The fast torch backend (batched decodes, SDPA) equals the reference loop on fresh
random inputs. float32 tolerance: 1e-5.

The cache is not NaN-poisoned here: this backend gathers whole pages and masks the
unused slots, and a masked NaN still poisons ``probs @ V`` (0 * NaN). In the engine
a slot holds zeros or stale finite values, never NaN."""

import pytest
import torch

from microvllm.attention.torch_ref import paged_attention_torch
from microvllm.attention.torch_sdpa import paged_attention_sdpa
from microvllm.bench.attention import random_paged_batch
from tests.attention.cases import HEADS, WINDOWS, batch_lengths, seed_for


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("block_size", [1, 16])
def test_matches_reference(kind, heads, window, block_size, request):
    query_lens, seq_lens = batch_lengths(kind, max(block_size, 4))
    num_heads, num_kv_heads = HEADS[heads]
    query, kv_cache, metadata = random_paged_batch(
        query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16,
        block_size=block_size, seed=seed_for(request.node.name), poison=False)
    sliding_window = WINDOWS[window]
    expected = paged_attention_torch(query, kv_cache, metadata, scale=0.25, sliding_window=sliding_window)
    got = paged_attention_sdpa(query, kv_cache, metadata, scale=0.25, sliding_window=sliding_window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_decodes_first_fast_path_matches_reference():
    """With the runner's promise that decodes come first (``num_decodes``), the backend
    slices instead of gathering rows, and reuses one mask for every layer."""
    query_lens, seq_lens = [1, 1, 1, 7, 3], [5, 40, 17, 7, 20]
    query, kv_cache, metadata = random_paged_batch(
        query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
        seed=3, poison=False)
    metadata.num_decodes = 3
    expected = paged_attention_torch(query, kv_cache, metadata, scale=0.25, sliding_window=6)
    for _ in range(2):  # the second call reuses metadata.per_step
        got = paged_attention_sdpa(query, kv_cache, metadata, scale=0.25, sliding_window=6)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert ("decode_layout", 6) in metadata.per_step
