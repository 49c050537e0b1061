"""Shared inputs and checks for the attention kernel tests.

Every test builds fresh random inputs with ``random_paged_batch`` (pages scattered
over the pool in random order, free cache slots poisoned with NaN), seeded from the
test's own name so that each test sees different numbers, the same on every run.

Tolerances against the float32 torch reference:
    float32: rtol = atol = 1e-5  (the kernels accumulate in float32 too; only the
             order of additions differs, observed errors are ~1e-6)
    float16: rtol = atol = 1e-2  (the kernels round the softmax probabilities to
             float16 before P @ V, as flash attention does; observed ~1e-3)
"""

from __future__ import annotations

import zlib

import torch

from microvllm.bench.attention import random_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5),
             torch.float16: dict(rtol=1e-2, atol=1e-2),
             torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# query heads : KV heads (small head counts keep the interpreter fast)
HEADS = {"1:1": (2, 2), "2:1": (4, 2), "4:1": (8, 2), "mqa": (4, 1)}
WINDOWS = {None: None, "short": 5, "long": 1000}   # "long" is longer than any context here


def batch_lengths(kind: str, block_size: int) -> tuple[list[int], list[int]]:
    """``(query_lens, seq_lens)``: ragged, with sequences of length 1 and exact
    multiples of the block size."""
    bs = block_size
    if kind == "decode":
        return [1, 1, 1, 1, 1], [1, bs, 2 * bs + 5, 3 * bs, 50]
    if kind == "prefill":   # fresh prompts, and a later chunk over cached context
        return [1, bs, 19, 6], [1, bs, 19, 2 * bs + 6]
    if kind == "mixed":     # prefill chunks and decodes in one step
        return [9, 1, bs + 3, 1, 1], [9, 1, 2 * bs + 3, 2 * bs, 37]
    raise ValueError(kind)


def seed_for(test_name: str) -> int:
    return zlib.crc32(test_name.encode())


def make_batch(query_lens, seq_lens, *, heads="2:1", head_dim=16, block_size=16,
               dtype="f32", seed=0, **kwargs):
    num_heads, num_kv_heads = HEADS[heads]
    return random_paged_batch(query_lens, seq_lens, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, head_dim=head_dim,
                              block_size=block_size, dtype=DTYPES[dtype], device=DEVICE,
                              seed=seed, **kwargs)


def poisoned_like(query: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel forgets to write stays NaN."""
    return torch.full_like(query, float("nan"))


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, num_tokens: int) -> None:
    actual, expected = actual[:num_tokens], expected[:num_tokens]
    assert not actual.isnan().any(), "the kernel left NaN in the output (unwritten rows?)"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[actual.dtype])
