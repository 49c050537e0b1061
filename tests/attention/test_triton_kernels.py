"""The Triton kernels against the torch reference (``torch_ref.py``), on a CPU through
Triton's interpreter (TRITON_INTERPRET=1, set in tests/conftest.py).

The interpreter is slow, so the cases below are small and chosen *pairwise*: every
pair of values of any two factors (batch kind, heads ratio, head dim, window, block
size, dtype) appears in some case, without running the full cross-product.
"""

import pytest
import torch

from microvllm.attention.torch_ref import paged_attention_torch, write_kv_torch
from microvllm.attention.triton_kernels.decode import decode_attention
from microvllm.attention.triton_kernels.unified import unified_attention
from microvllm.attention.triton_kernels.write_kv import write_kv
from tests.attention.cases import WINDOWS, assert_matches, batch_lengths, make_batch, poisoned_like, seed_for

# kind, heads (query:KV), head_dim, window, block_size, dtype
UNIFIED_CASES = [
    ("decode", "1:1", 16, "long", 16, "f16"),
    ("decode", "2:1", 64, "short", 32, "f16"),
    ("decode", "4:1", 16, None, 32, "f32"),
    ("decode", "mqa", 128, "long", 32, "f16"),
    ("mixed", "1:1", 64, None, 32, "f32"),
    ("mixed", "2:1", 128, None, 32, "f16"),
    ("mixed", "4:1", 16, "short", 16, "f32"),
    ("mixed", "4:1", 64, "long", 16, "f16"),
    ("mixed", "mqa", 16, None, 16, "f32"),
    ("prefill", "1:1", 128, "short", 16, "f32"),
    ("prefill", "2:1", 16, "long", 16, "f32"),
    ("prefill", "4:1", 128, None, 16, "f32"),
    ("prefill", "mqa", 64, "short", 32, "f16"),
]

# heads, head_dim, window, block_size, dtype (every batch is decode-only)
DECODE_CASES = [
    ("1:1", 16, None, 16, "f32"),
    ("1:1", 64, "short", 32, "f16"),
    ("2:1", 128, "long", 16, "f32"),
    ("2:1", 16, "short", 32, "f32"),
    ("4:1", 64, None, 32, "f16"),
    ("4:1", 128, "short", 16, "f16"),
    ("mqa", 16, "long", 32, "f16"),
    ("mqa", 128, None, 16, "f32"),
    ("4:1", 16, "long", 16, "f32"),
]


def _case_id(case) -> str:
    return "-".join(str(x) for x in case)


def _run(kernel, request, kind, heads, head_dim, window, block_size, dtype):
    query_lens, seq_lens = batch_lengths(kind, block_size)
    query, kv_cache, metadata = make_batch(query_lens, seq_lens, heads=heads, head_dim=head_dim,
                                           block_size=block_size, dtype=dtype,
                                           seed=seed_for(request.node.name))
    scale = head_dim ** -0.5
    expected = paged_attention_torch(query, kv_cache, metadata, scale=scale,
                                     sliding_window=WINDOWS[window])
    out = kernel(query, kv_cache, metadata, scale=scale, sliding_window=WINDOWS[window],
                 out=poisoned_like(query))
    assert_matches(out, expected, metadata.num_actual_tokens)


@pytest.mark.parametrize("case", UNIFIED_CASES, ids=_case_id)
def test_unified_kernel_matches_reference(request, case):
    _run(unified_attention, request, *case)


@pytest.mark.parametrize("case", DECODE_CASES, ids=_case_id)
def test_decode_kernel_matches_reference(request, case):
    _run(decode_attention, request, "decode", *case)


@pytest.mark.parametrize("kernel", [unified_attention, decode_attention],
                         ids=["unified", "decode"])
@pytest.mark.parametrize("window", [5, 16])
def test_window_starts_at_every_offset_in_a_page(request, kernel, window):
    # Decodes at positions window-1 .. window+16: the first visible key falls on every
    # slot of a 16-token page, including its first and last (pages skipped by the
    # window must be exactly the ones before it). The unified kernel also gets
    # chunks whose q-blocks start at many offsets.
    query_lens = [1] * 18
    seq_lens = list(range(window, window + 18))
    if kernel is unified_attention:
        query_lens, seq_lens = query_lens + [37, 29], seq_lens + [40, 61]
    query, kv_cache, metadata = make_batch(query_lens, seq_lens, seed=seed_for(request.node.name))
    expected = paged_attention_torch(query, kv_cache, metadata, scale=0.25, sliding_window=window)
    out = kernel(query, kv_cache, metadata, scale=0.25, sliding_window=window,
                 out=poisoned_like(query))
    assert_matches(out, expected, metadata.num_actual_tokens)


def test_decode_kernel_refuses_prefill_batches():
    query, kv_cache, metadata = make_batch(*batch_lengths("mixed", 16))
    with pytest.raises(ValueError, match="max_query_len"):
        decode_attention(query, kv_cache, metadata, scale=1.0)


@pytest.mark.parametrize("kernel", [unified_attention, decode_attention],
                         ids=["unified", "decode"])
def test_rows_with_nothing_to_attend_are_zero(request, kernel):
    # Request 1 is not scheduled this step (no query rows); request 2's only row sits
    # before any key (seq_len 0); with a window of 1 the others see only themselves.
    query_lens, seq_lens = [1, 0, 1, 1], [17, 5, 0, 1]
    query, kv_cache, metadata = make_batch(query_lens, seq_lens, seed=seed_for(request.node.name))
    for window in (None, 1):
        expected = paged_attention_torch(query, kv_cache, metadata, scale=0.25,
                                         sliding_window=window)
        out = kernel(query, kv_cache, metadata, scale=0.25, sliding_window=window,
                     out=poisoned_like(query))
        assert_matches(out, expected, metadata.num_actual_tokens)
        assert torch.equal(out[1], torch.zeros_like(out[1]))   # the seq_len 0 row


def test_unified_kernel_zeroes_rows_before_the_sequence(request):
    # Off-spec but well defined: a chunk longer than its sequence puts its first rows
    # at negative positions, where no key exists -> zeros, never NaN.
    query, kv_cache, metadata = make_batch([3, 2], [1, 20], seed=seed_for(request.node.name))
    expected = paged_attention_torch(query, kv_cache, metadata, scale=0.25)
    out = unified_attention(query, kv_cache, metadata, scale=0.25, out=poisoned_like(query))
    assert_matches(out, expected, metadata.num_actual_tokens)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))


def test_unified_kernel_reads_a_strided_query(request):
    # In a model, q is a view into the fused qkv projection: rows are not contiguous.
    query, kv_cache, metadata = make_batch(*batch_lengths("mixed", 16), heads="2:1",
                                           seed=seed_for(request.node.name))
    qkv = torch.randn(query.shape[0], 8, 16, device=query.device)
    qkv[:, :4] = query
    strided = qkv[:, :4]
    expected = paged_attention_torch(query, kv_cache, metadata, scale=0.25)
    out = unified_attention(strided, kv_cache, metadata, scale=0.25, out=poisoned_like(query))
    assert_matches(out, expected, metadata.num_actual_tokens)


@pytest.mark.parametrize("block_size,dtype", [(16, "f32"), (32, "f16")])
def test_write_kv_matches_torch(request, block_size, dtype):
    query_lens, seq_lens = batch_lengths("mixed", block_size)
    _, kv_cache, metadata = make_batch(query_lens, seq_lens, heads="4:1", head_dim=64,
                                       block_size=block_size, dtype=dtype,
                                       seed=seed_for(request.node.name))
    num_tokens, (num_kv_heads, head_dim) = metadata.num_actual_tokens, kv_cache.shape[3:]
    # key and value as views of a fused projection (strided rows), in float32: the
    # kernel casts them to the cache's dtype, like write_kv_torch.
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, device=kv_cache.device)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:2 * num_kv_heads]
    expected = kv_cache.clone()
    write_kv_torch(key, value, expected, metadata.slot_mapping)
    write_kv(key, value, kv_cache, metadata.slot_mapping)
    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0, equal_nan=True)


def test_write_kv_skips_padding_slots(request):
    _, kv_cache, metadata = make_batch([2, 1], [2, 1], seed=seed_for(request.node.name))
    key = torch.randn(4, *kv_cache.shape[3:], device=kv_cache.device)
    value = torch.randn_like(key)
    slots = torch.cat([metadata.slot_mapping,
                       torch.tensor([-1], device=kv_cache.device)])  # token 3: padding
    expected = kv_cache.clone()
    write_kv_torch(key[:3], value[:3], expected, metadata.slot_mapping)
    write_kv(key, value, kv_cache, slots)
    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 needs a GPU: Triton's "
                    "CPU interpreter computes bfloat16 wrongly")
@pytest.mark.parametrize("kernel", [unified_attention, decode_attention],
                         ids=["unified", "decode"])
def test_bfloat16_on_gpu(request, kernel):
    _run(kernel, request, "decode", "4:1", 128, None, 16, "bf16")


@pytest.mark.parametrize("kernel", [unified_attention, decode_attention],
                         ids=["unified", "decode"])
def test_empty_batch_launches_nothing(kernel):
    query, kv_cache, metadata = make_batch([], [])
    assert kernel(query, kv_cache, metadata, scale=1.0).shape == (0, 4, 16)
