"""Capture sizes and the padding of a decode batch (platforms/padded_decode_batch.py):
the bookkeeping behind CUDA graphs, checked on a CPU, including that padding rows
never change the real rows' outputs (the Triton kernels, in the interpreter here)."""

from __future__ import annotations

import pytest
import torch

from microvllm.attention.metadata import AttentionMetadata
from microvllm.platforms.padded_decode_batch import (
    PAD_SLOT_ID,
    PaddedDecodeBatch,
    cudagraph_capture_sizes,
    padded_batch_size,
)

BLOCK = 16


def test_capture_sizes_follow_vllm():
    assert cudagraph_capture_sizes(1) == [1]
    assert cudagraph_capture_sizes(20) == [1, 2, 4, 8, 16]
    assert cudagraph_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert cudagraph_capture_sizes(10_000)[-1] == 512


@pytest.mark.parametrize("num_reqs, expected", [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (16, 16), (17, None)])
def test_padded_to_the_next_captured_size(num_reqs, expected):
    assert padded_batch_size(num_reqs, [1, 2, 4, 8, 16]) == expected


def decode_batch(seq_lens: list[int], tables: list[list[int]], vocab: int = 100, seed: int = 0):
    """A real decode batch: one token per request at position seq_len - 1."""
    g = torch.Generator().manual_seed(seed)
    n = len(seq_lens)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    positions = torch.tensor([s - 1 for s in seq_lens])
    slots = table[torch.arange(n), positions // BLOCK].long() * BLOCK + positions % BLOCK
    metadata = AttentionMetadata(
        num_actual_tokens=n, max_query_len=1, max_seq_len=max(seq_lens),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table, slot_mapping=slots,
        query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=list(seq_lens), num_decodes=n)
    return torch.randint(0, vocab, (n,), generator=g), positions, metadata


def test_fill_copies_real_rows_and_pads_the_rest():
    batch = PaddedDecodeBatch([1, 2, 4, 8], num_groups=1, max_blocks_per_req=4, max_model_len=64)
    ids, positions, metadata = decode_batch([41, 4, 18], [[2, 7, 5], [4], [3, 9]])
    size = batch.fill(ids, positions, [metadata])
    assert size == 4
    ids4, pos4, (m,) = batch.inputs(4)
    assert ids4.tolist() == ids.tolist() + [0] and pos4.tolist() == [40, 3, 17, 0]
    assert m.slot_mapping.tolist() == [5 * 16 + 8, 4 * 16 + 3, 9 * 16 + 1, PAD_SLOT_ID]
    assert m.seq_lens.tolist() == [41, 4, 18, 1]
    assert m.block_table[:, :3].tolist() == [[2, 7, 5], [4, 0, 0], [3, 9, 0], [0, 0, 0]]
    assert m.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert (m.num_actual_tokens, m.max_query_len, m.num_reqs, m.max_seq_len) == (4, 1, 4, 64)

    # A smaller batch later: the same metadata objects (a graph keeps their addresses),
    # and the rows the bigger batch left behind are padding again.
    ids, positions, metadata = decode_batch([5, 6], [[8], [6]])
    assert batch.fill(ids, positions, [metadata]) == 2
    assert batch.metadata(4)[0] is m and batch.metadata(2)[0].seq_lens.data_ptr() == m.seq_lens.data_ptr()
    assert batch.fill(*decode_batch([5], [[8]])[:2], [decode_batch([5], [[8]])[2]]) == 1
    assert batch.fill(*decode_batch([5, 6, 7], [[8], [6], [1]])[:2],
                      [decode_batch([5, 6, 7], [[8], [6], [1]])[2]]) == 4
    assert m.seq_lens.tolist() == [5, 6, 7, 1] and m.slot_mapping[3].item() == PAD_SLOT_ID


def test_fill_refuses_what_is_not_a_small_decode_batch():
    batch = PaddedDecodeBatch([1, 2, 4], num_groups=1, max_blocks_per_req=4, max_model_len=64)
    ids, positions, metadata = decode_batch([3] * 5, [[1]] * 5)
    with pytest.raises(ValueError, match="run it eagerly"):
        batch.fill(ids, positions, [metadata])
    ids, positions, metadata = decode_batch([3, 4], [[1], [2]])
    metadata.max_query_len = 2  # a prefill chunk
    with pytest.raises(ValueError, match="not a decode batch"):
        batch.fill(ids, positions, [metadata])


@pytest.fixture(scope="module")
def triton_llama(tiny_models):
    from microvllm.attention.triton_backend import TritonAttentionBackend
    from microvllm.models.loader import load_model

    model, _ = load_model(tiny_models["llama"], TritonAttentionBackend())
    return model


def kv_caches_for(model, num_blocks: int, seed: int = 1):
    """Random keys and values in every block but the null block (block 0: zeros)."""
    g = torch.Generator().manual_seed(seed)
    attn = model.layers[0].self_attn
    caches = []
    for _ in model.layers:
        cache = torch.randn(2, num_blocks, BLOCK, attn.num_kv_heads, attn.head_dim, generator=g)
        cache[:, 0] = 0
        caches.append(cache)
    return caches


@torch.inference_mode()
def test_padding_rows_never_change_the_real_rows(triton_llama):
    model = triton_llama
    ids, positions, metadata = decode_batch([41, 4, 18], [[2, 7, 5], [4], [3, 9]],
                                            vocab=model.config.vocab_size)
    eager_caches = kv_caches_for(model, 10)
    eager = model(ids, positions, eager_caches, [metadata])

    batch = PaddedDecodeBatch([1, 2, 4, 8], num_groups=1, max_blocks_per_req=4, max_model_len=64)
    size = batch.fill(ids, positions, [metadata])
    padded_caches = kv_caches_for(model, 10)
    padded = model(*batch.inputs(size)[:2], padded_caches, batch.metadata(size))
    assert size == 4 and torch.isfinite(padded).all()
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
    # Padding wrote nothing: only the three real slots changed, the null block is still zeros.
    before = kv_caches_for(model, 10)
    for after, eager_after, untouched in zip(padded_caches, eager_caches, before):
        changed = (after != untouched).flatten(3).any(-1).any(0).flatten().nonzero().flatten()
        assert changed.tolist() == sorted(metadata.slot_mapping.tolist())
        assert not after[:, 0].any()
        torch.testing.assert_close(after, eager_after, rtol=1e-5, atol=1e-5)

    # Other values in the padding row: the real rows are the same, bit for bit.
    batch.input_ids[3], batch.positions[3] = 7, 33
    again = model(*batch.inputs(size)[:2], kv_caches_for(model, 10), batch.metadata(size))
    assert torch.equal(again[:3], padded[:3])
