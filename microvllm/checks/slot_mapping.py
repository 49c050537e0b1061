"""Checks for exercise 07 (model runner), part 1: ``BlockTable.slot_mapping``, compared
with the formula written out as a Python loop, on fixed and random batches."""

from __future__ import annotations

import torch

from microvllm.checks.report import Case, CheckResult, expect, expect_equal, property_settings, run_checks, run_property

B = 4


def _slots(table: list[int], positions) -> list[int]:
    return [table[p // B] * B + p % B for p in positions]


def check_slot_mapping(block_table_class, *, max_examples: int = 60, quiet: bool = False) -> CheckResult:
    """Check ``slot_mapping`` of a ``BlockTable`` class."""

    def run(tables: list[list[int]], chunks: list[tuple[int, int]]):
        """tables[i]: request i's block ids; chunks[i]: (first position, number of tokens)."""
        bt = block_table_class(max_num_reqs=8, max_blocks_per_req=16, block_size=B)
        names = [f"r{i}" for i in range(len(tables))]
        for name, table in zip(names, tables):
            bt.add_request(name, list(table))
        width = max(len(t) for t in tables)
        batch_table = bt.gather(names, width)
        request_index = torch.tensor([i for i, (_, n) in enumerate(chunks) for _ in range(n)], dtype=torch.long)
        positions = torch.tensor([p for start, n in chunks for p in range(start, start + n)], dtype=torch.long)
        got = bt.slot_mapping(batch_table, request_index, positions)
        expected = [s for table, (start, n) in zip(tables, chunks) for s in _slots(table, range(start, start + n))]
        where = f"block size {B}; " + "; ".join(
            f"request {i}: block table {t}, positions {start}..{start + n - 1}"
            for i, (t, (start, n)) in enumerate(zip(tables, chunks)))
        expect(isinstance(got, torch.Tensor) and got.shape == (len(expected),),
               "slot_mapping must return a tensor with one slot per token", input=where,
               got=f"{type(got).__name__} {tuple(getattr(got, 'shape', ()))}")
        expect_equal(got.tolist(), expected, "the slot of each token", input=where,
                     hint="slot = block_table[request, position // block_size] * block_size "
                          "+ position % block_size: the *physical* block id from the table, "
                          "then the offset inside the block")
        expect(got.dtype == torch.int64, "slots must be int64 (they index a flat cache of many blocks)",
               got=str(got.dtype), hint="call .long() on the block ids before multiplying")

    def one_request():
        run([[7, 3, 12]], [(0, 10)])

    def chunk_later_in_the_sequence():
        run([[5, 9, 2, 6]], [(6, 7)])

    def a_batch():
        run([[7, 3, 12], [4, 9], [1]], [(8, 4), (5, 1), (0, 3)])

    def random_batches():
        from hypothesis import given, strategies as st

        @property_settings(max_examples)
        @given(st.integers(1, 5), st.randoms(use_true_random=False))
        def test(num_requests, rng):
            ids = list(range(1, 64))
            rng.shuffle(ids)
            tables, chunks = [], []
            for _ in range(num_requests):
                seq_len = rng.randint(1, 40)
                num_blocks = -(-seq_len // B)
                tables.append([ids.pop() for _ in range(num_blocks)])
                n = rng.randint(1, seq_len)
                chunks.append((seq_len - n, n))
            run(tables, chunks)

        run_property(test)

    cases = [
        Case("one request's prompt across three scattered blocks", one_request),
        Case("a chunk that starts in the middle of the sequence", chunk_later_in_the_sequence),
        Case("a batch of a chunk, a decode and a short prompt", a_batch),
        Case(f"property: {max_examples} random batches", random_batches),
    ]
    return run_checks("check_slot_mapping", cases, quiet=quiet)


