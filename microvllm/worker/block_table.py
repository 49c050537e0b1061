"""The runner's persistent block table: one row per running request, kept between steps.

The scheduler sends only the *new* block ids of a continuing request, so the runner
keeps each request's row and appends to it::

    rows (max_num_seqs x max_blocks_per_req, int32)       row_of_request
      row 0: [ 7  3 12  0  0 ...]   <- request "a"          {"a": 0,
      row 1: [ 4  9  0  0  0 ...]   <- request "b"           "b": 1}
      row 2: (free)

Each step the rows of the scheduled requests are gathered into the batch's
``block_table [num_reqs, max_blocks]`` with one ``index_select``; ``slot_mapping``
is computed from it without a Python loop over tokens.
"""

from __future__ import annotations

import torch


class BlockTable:
    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, block_size: int):
        self.block_size = block_size
        self.rows = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int32)
        self.num_blocks = [0] * max_num_reqs  # blocks used in each row
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.row_of_request: dict[str, int] = {}

    def add_request(self, request_id: str, block_ids) -> None:
        row = self.free_rows.pop()
        self.row_of_request[request_id] = row
        self.num_blocks[row] = 0
        self.append(request_id, block_ids)

    def append(self, request_id: str, block_ids) -> None:
        if not block_ids:
            return
        row = self.row_of_request[request_id]
        start = self.num_blocks[row]
        if start + len(block_ids) > self.rows.shape[1]:
            raise RuntimeError(f"request {request_id!r} needs more than {self.rows.shape[1]} "
                               "blocks: max_model_len is smaller than the scheduler allowed")
        self.rows[row, start:start + len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        self.num_blocks[row] = start + len(block_ids)

    def remove_request(self, request_id: str) -> None:
        row = self.row_of_request.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)

    def gather(self, request_ids: list[str], max_blocks: int) -> torch.Tensor:
        """``[len(request_ids), max_blocks]`` block table of this step's batch."""
        rows = torch.tensor([self.row_of_request[r] for r in request_ids], dtype=torch.long)
        return self.rows[rows, :max_blocks]

    def slot_mapping(self, batch_table: torch.Tensor, request_index: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        """``slot[t] = block_table[req(t), pos(t) // B] * B + pos(t) % B`` for every token t."""
        ### BEGIN SOLUTION
        block_ids = batch_table[request_index, positions // self.block_size].long()
        return block_ids * self.block_size + positions % self.block_size
        ### END SOLUTION
