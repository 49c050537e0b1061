"""A decode batch padded to a captured size: the bookkeeping behind CUDA graphs.

A CUDA graph replays the kernel launches it recorded with the *same* shapes and the
*same* memory addresses. So a decode step can replay a graph only if its inputs sit
in persistent buffers and its batch has a size that was captured. vLLM captures a
list of sizes (``cudagraph_capture_sizes``) and pads each decode batch up to the
next one (``pad_for_cudagraph``); microvllm does the same. Nothing here needs CUDA:
``tests/platforms/test_padded_decode_batch.py`` checks it on a CPU.

Three decodes padded to the captured size 4 (block_size 16, null block = block 0)::

    row                 0     1     2   | 3        <- padding row
    input_ids          [17,   93,   5,  | 0 ]
    positions          [40,   3,    17, | 0 ]
    slot_mapping       [5*16+8, 4*16+3, 9*16+1, | -1]   -1: write_kv stores nothing
    seq_lens           [41,   4,    18, | 1 ]
    block_table        [[2 7 5 ..], [4 0 ..], [3 9 0 ..], | [0 0 ..]]   null block
    query_start_loc    [0, 1, 2, 3, | 4]          one query row each, always arange

What the Triton kernels do with a padding row: ``write_kv`` returns at once for slot
-1 (nothing is written, so the null block stays all zeros); the unified kernel sees a
request of one query token with ``seq_len`` 1, visits one page, block 0, and
attends to its single key: the null block's zeros, so the row's output is a finite 0.
(``seq_len`` 0 would also work, no key visible gives zeros too, but it makes the
kernel lean on the ``l == 0`` guard and on how ``-1 // block_size`` rounds.) Every
other layer (norms, projections, MLP) works row by row, so a padding row never
changes a real row: the model runner takes ``hidden[:3]`` and drops the rest.

Each capture size gets one ``AttentionMetadata`` whose tensors are views of the same
buffers, made once: the graph recorded their addresses, so ``fill`` writes the step's
values into them in place and never replaces a tensor.
"""

from __future__ import annotations

import bisect

import torch

from microvllm.attention.metadata import AttentionMetadata

PAD_SLOT_ID = -1     # vLLM's name: a token whose key/value is not stored
NULL_BLOCK_ID = 0    # block 0 is never allocated to a request (core/block_pool.py)
MAX_CAPTURE_SIZE = 512


def cudagraph_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's default list, cut at ``max_num_seqs``: 1, 2, 4, then every multiple of 8::

        max_num_seqs=20  ->  [1, 2, 4, 8, 16]        a batch of 17..20 runs eagerly
        max_num_seqs=64  ->  [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    """
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be a positive int")
    candidates = [1, 2, 4] + list(range(8, MAX_CAPTURE_SIZE + 1, 8))
    return [size for size in candidates if size <= max_num_seqs]


def padded_batch_size(num_reqs: int, capture_sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_reqs`` rows (vLLM: ``pad_for_cudagraph``),
    or None if the batch is larger than every one (it then runs eagerly)::

        capture_sizes [1, 2, 4, 8, 16]:   3 -> 4,  8 -> 8,  9 -> 16,  17 -> None
    """
    if num_reqs < 1:
        raise ValueError(f"num_reqs={num_reqs}: a decode batch has at least one request")
    index = bisect.bisect_left(capture_sizes, num_reqs)
    return capture_sizes[index] if index < len(capture_sizes) else None


class PaddedDecodeBatch:
    """The persistent inputs of a captured decode step (the module docstring draws them),
    sized for ``max_size`` rows, one set of attention tensors per cache group."""

    def __init__(self, capture_sizes: list[int], num_groups: int, max_blocks_per_req: int,
                 max_model_len: int, device: torch.device | str = "cpu"):
        if not capture_sizes or sorted(set(capture_sizes)) != list(capture_sizes):
            raise ValueError(f"capture_sizes={capture_sizes!r} must be a non-empty increasing list")
        self.capture_sizes = list(capture_sizes)
        self.max_size = capture_sizes[-1]
        self.max_model_len = max_model_len
        n = self.max_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = [torch.full((n,), PAD_SLOT_ID, dtype=torch.long, device=device)
                             for _ in range(num_groups)]
        self.seq_lens = [torch.ones(n, dtype=torch.int32, device=device) for _ in range(num_groups)]
        self.block_table = [torch.full((n, max_blocks_per_req), NULL_BLOCK_ID, dtype=torch.int32,
                                       device=device) for _ in range(num_groups)]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._metadata: dict[int, list[AttentionMetadata]] = {}

    def padded_size(self, num_reqs: int) -> int | None:
        return padded_batch_size(num_reqs, self.capture_sizes)

    def metadata(self, size: int) -> list[AttentionMetadata]:
        """The attention metadata of a batch of ``size`` rows, one per cache group: views of
        the persistent buffers, the same objects at capture and at every replay.
        ``max_seq_len`` is ``max_model_len`` (an upper bound: a graph cannot take a new
        Python number per step; the Triton kernels read each row's ``seq_lens`` instead)."""
        if size not in self._metadata:
            self._metadata[size] = [AttentionMetadata(
                num_actual_tokens=size, max_query_len=1, max_seq_len=self.max_model_len,
                query_start_loc=self.query_start_loc[:size + 1], seq_lens=seq_lens[:size],
                block_table=table[:size], slot_mapping=slots[:size],
                query_start_loc_cpu=list(range(size + 1)), num_decodes=size)
                for seq_lens, table, slots in zip(self.seq_lens, self.block_table, self.slot_mapping)]
        return self._metadata[size]

    def inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
        """``(input_ids, positions, metadata)`` of a ``size``-row batch, as the model takes them."""
        return self.input_ids[:size], self.positions[:size], self.metadata(size)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor,
             metadata: list[AttentionMetadata]) -> int:
        """Copy a decode batch of ``n`` rows into the buffers, pad rows ``n .. size-1``,
        and return ``size`` (the captured size it was padded to)."""
        n = len(input_ids)
        size = self.padded_size(n)
        if size is None or any(m.max_query_len != 1 or m.num_actual_tokens != n for m in metadata):
            raise ValueError(f"a batch of {n} tokens is not a decode batch of at most "
                             f"{self.max_size} requests: run it eagerly (check applies() first)")
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:size].zero_()
        for group, step in enumerate(metadata):
            width = step.block_table.shape[1]
            self.slot_mapping[group][:n].copy_(step.slot_mapping)
            self.slot_mapping[group][n:size].fill_(PAD_SLOT_ID)
            self.seq_lens[group][:n].copy_(step.seq_lens)
            self.seq_lens[group][n:size].fill_(1)
            # Entries past a row's last page are never read (the kernel stops at seq_len).
            self.block_table[group][:n, :width].copy_(step.block_table)
            self.block_table[group][n:size].fill_(NULL_BLOCK_ID)
        for step in self.metadata(size):
            step.per_step.clear()  # a backend's per-step scratch must not outlive the step
        return size
