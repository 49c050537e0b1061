"""The profiling pass: one forward of the largest batch the scheduler may send, on
dummy tokens, so that the GPU's peak memory shows what activations cost (vLLM:
``GPUModelRunner.profile_run``). ``worker/gpu_memory.py`` turns the peak into a
number of KV cache blocks.

The batch is ``max_num_batched_tokens`` tokens of prefill, cut into requests of at
most ``max_model_len`` tokens, written into a scratch KV cache of just enough blocks
(freed afterwards), then the logits of ``max_num_seqs`` rows::

    num_tokens = 40, max_model_len = 16, block_size = 16
    request       r0 (16)          r1 (16)          r2 (8)
    blocks        [1]              [2]              [3]          scratch cache: 4 blocks
    positions     0..15            0..15            0..7
"""

from __future__ import annotations

import torch

from microvllm.attention.metadata import AttentionMetadata


def dummy_prefill_batch(num_tokens: int, max_model_len: int, block_size: int, num_groups: int,
                        device: torch.device | str = "cpu"):
    """``(input_ids, positions, metadata per cache group, num_blocks)`` of the batch drawn
    above; ``num_blocks`` counts the null block."""
    lengths = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
    blocks_per_req = [-(-n // block_size) for n in lengths]
    max_blocks = max(blocks_per_req)
    block_table = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
    next_block = 1  # block 0: the null block
    for row, count in enumerate(blocks_per_req):
        block_table[row, :count] = torch.arange(next_block, next_block + count, dtype=torch.int32)
        next_block += count
    positions = torch.cat([torch.arange(n) for n in lengths])
    request_index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    slot_mapping = (block_table[request_index, positions // block_size].long() * block_size
                    + positions % block_size)
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    metadata = [AttentionMetadata(
        num_actual_tokens=num_tokens, max_query_len=max(lengths), max_seq_len=max(lengths),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_table=block_table.to(device), slot_mapping=slot_mapping.to(device),
        query_start_loc_cpu=qsl, seq_lens_cpu=lengths, num_decodes=0) for _ in range(num_groups)]
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    return input_ids, positions.to(device), metadata, next_block


@torch.inference_mode()
def profile_run(model, *, num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Run the batch drawn in the module docstring through ``model``; returns the logits
    (``[min(max_num_seqs, num_tokens), vocab]``) so a test can check it ran."""
    input_ids, positions, metadata, num_blocks = dummy_prefill_batch(
        num_tokens, max_model_len, block_size, model.layout.num_groups, device)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.layers]
    hidden = model(input_ids, positions, kv_caches, metadata)
    return model.compute_logits(hidden[:min(max_num_seqs, num_tokens)]).float()
