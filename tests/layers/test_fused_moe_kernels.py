"""The three mixture-of-experts paths agree: step (a) ``fused_moe_iterative`` is the
reference; step (b) ``fused_moe_sorted`` must match it bit for bit (block_size 1), and
step (c) ``fused_experts`` (the Triton kernel; on a CPU in Triton's interpreter, switched
on by tests/conftest.py) within rounding. Also the invariants of ``moe_align_block_size``,
which both (b) and (c) rely on.

Every test builds fresh random inputs from its own seeded generator. Shapes are small (the
interpreter runs one program at a time, in numpy) but chosen to hit the edges: T not a
multiple of the block, H and I not multiples of BLOCK_SIZE_K / BLOCK_SIZE_N, experts with
no token, top_k == E, T = 1, and ids of -1 (experts held by another rank).

Tolerances of ``fused_experts`` against ``fused_moe_iterative`` (outputs are O(1): the
weights are scaled by 1/sqrt(fan-in)):
    float32:  rtol = atol = 1e-5. Both accumulate in float32 and differ only in the order
              of the additions (the kernel sums K in slices of 32); observed <= 5e-7.
    bfloat16: rtol = 2e-2, atol = 3e-2. Both round to bfloat16 (8 significant bits: one
              ulp is 2^-8 to 2^-7 of the value) after each matmul, after silu*up and after
              weighting, in different places: step (a) rounds y, then y * weight, then
              each partial sum over k; the kernel rounds y * weight once and sums k in
              float32. So each is a few roundings of O(1) intermediates away from the
              exact result, in its own direction; rtol is ~2.5 ulps of the value, atol
              covers outputs near zero (cancellation of O(1) terms). Triton's interpreter
              also rounds float32 -> bfloat16 towards zero, not to nearest, which adds
              about an ulp. Observed over 84 random cases: at most 4 ulps (0.0625 at
              |value| ~3).
"""

from __future__ import annotations

import subprocess
import sys
import zlib

import pytest
import torch

from microvllm.layers.fused_moe.fused_moe import fused_experts
from microvllm.layers.fused_moe.moe_align_block_size import moe_align_block_size
from microvllm.layers.fused_moe.moe_sorted import fused_moe_sorted
from microvllm.layers.fused_moe.moe_torch_iterative import fused_moe_iterative

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5),
             torch.bfloat16: dict(rtol=2e-2, atol=3e-2)}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}

# name: (T, H, I, E, top_k, routing). H = 72 and I = 40 are multiples of neither
# BLOCK_SIZE_K = 32 nor BLOCK_SIZE_N = 64; T = 37 and 19 are not multiples of 16.
CASES = {
    "ragged": (37, 72, 40, 6, 2, "softmax"),
    "idle-experts": (23, 40, 24, 8, 2, "only 1 4 6"),   # five experts get no token
    "topk-all": (20, 32, 16, 4, 4, "softmax"),          # every token goes to every expert
    "single-token": (1, 72, 40, 8, 2, "softmax"),
    "minus-one": (19, 40, 24, 4, 2, "some -1"),         # token 0's pairs both -1, and more
    "all-minus-one": (5, 32, 16, 4, 2, "all -1"),       # nothing local: nothing launched
    "no-tokens": (0, 32, 16, 4, 2, "softmax"),
}


def generator(name: str) -> torch.Generator:
    """A generator seeded from the test's name: different numbers per test, same per run."""
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def make_moe(name, T, H, inter, E, top_k, routing, dtype):
    """``(hidden, w13, w2, topk_weights, topk_ids)`` as the router and the model give them."""
    g = generator(name)
    hidden = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter ** 0.5
    logits = torch.randn(T, E, generator=g)
    if routing.startswith("only"):
        allowed = torch.zeros(E, dtype=torch.bool)
        allowed[[int(e) for e in routing.split()[1:]]] = True
        logits = logits.masked_fill(~allowed, float("-inf"))
    topk_weights, topk_ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    if routing == "some -1":
        topk_ids[torch.rand(T, top_k, generator=g) < 0.3] = -1
        topk_ids[0] = -1
    elif routing == "all -1":
        topk_ids[:] = -1
    return (hidden.to(DEVICE, dtype), w13.to(DEVICE, dtype), w2.to(DEVICE, dtype),
            topk_weights.to(DEVICE), topk_ids.to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES)
def test_fused_experts_matches_iterative(case, dtype):
    inputs = make_moe(f"fused/{case}", *CASES[case], dtype)
    out = fused_experts(*inputs)
    expected = fused_moe_iterative(*inputs)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])

def test_pairs_with_id_minus_one_add_nothing():
    """A token whose experts are all elsewhere gets exactly zero, not a stale buffer row."""
    hidden, w13, w2, weights, ids = make_moe("fused/zeros", *CASES["minus-one"], torch.float32)
    out = fused_experts(hidden, w13, w2, weights, ids)
    assert torch.equal(out[0], torch.zeros_like(out[0]))    # make_moe sends token 0 nowhere


def test_block_size_m():
    inputs = make_moe("fused/block32", *CASES["ragged"], torch.float32)
    torch.testing.assert_close(fused_experts(*inputs, block_size_m=32), fused_moe_iterative(*inputs),
                               **TOLERANCE[torch.float32])
    for bad in (8, 24):
        with pytest.raises(ValueError, match="power of two of at least 16"):
            fused_experts(*inputs, block_size_m=bad)


def test_importing_fused_moe_does_not_import_triton():
    code = ("import sys, microvllm.layers.fused_moe.fused_moe; "
            "assert 'triton' not in sys.modules, 'triton was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- step (b): the sorted path ---------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", ["ragged", "idle-experts", "topk-all", "single-token", "minus-one"])
def test_sorted_equals_iterative(case, dtype):
    inputs = make_moe(f"sorted/{case}", *CASES[case], dtype)
    expected = fused_moe_iterative(*inputs)
    # block_size 1: the same matmuls on the same rows, added in the same order.
    sorted_out = fused_moe_sorted(*inputs, block_size=1)
    if dtype == torch.float32 or CASES[case][4] <= 2:
        assert torch.equal(sorted_out, expected)
    else:
        # Not bit for bit in bfloat16 with top_k > 2: step (a) rounds `out` after each
        # expert's index_add_; step (b)'s single index_add_ (on a CPU) sums a token's k
        # rows in float32 and rounds once. With k <= 2 the first addition (to zero) is
        # exact, so both round once.
        torch.testing.assert_close(sorted_out, expected, **TOLERANCE[dtype])
    # block_size 16: each expert's matmul now sees its padding rows too, which may change
    # how the matmul splits its work, hence its rounding; nothing else.
    torch.testing.assert_close(fused_moe_sorted(*inputs, block_size=16), expected, **TOLERANCE[dtype])


# --- moe_align_block_size -----------------------------------------------------------------

def test_align_worked_example():
    """The example drawn in moe_align_block_size.py's docstring."""
    routing = moe_align_block_size(torch.tensor([[2, 0], [0, 1], [2, 0]]), 4, 4)
    assert routing.sorted_token_ids.tolist() == [1, 2, 5, 6, 3, 6, 6, 6, 0, 4, 6, 6]
    assert routing.expert_ids.tolist() == [0, 1, 2]
    assert routing.expert_offsets.tolist() == [0, 4, 8, 12, 12]
    assert routing.num_tokens_post_padded == 12


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("T, top_k, E", [(1, 1, 4), (1, 2, 8), (5, 2, 4), (37, 2, 8), (20, 4, 4),
                                         (64, 3, 16)])
def test_align_invariants(T, top_k, E, block_size):
    g = generator(f"align/{T}/{top_k}/{E}/{block_size}")
    for trial in range(4):
        if trial < 2:   # distinct experts per token, as the router gives them
            ids = torch.rand(T, E, generator=g).argsort(-1)[:, :top_k]
        else:           # any ids, repeats included, many experts idle
            ids = torch.randint(0, max(E // 2, 1), (T, top_k), generator=g)
        if trial % 2:
            ids[torch.rand(T, top_k, generator=g) < 0.25] = -1
        check_alignment(ids, block_size, E)


def check_alignment(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> None:
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    r = moe_align_block_size(topk_ids, block_size, num_experts)
    sorted_ids, offsets = r.sorted_token_ids.tolist(), r.expert_offsets.tolist()
    total = r.num_tokens_post_padded

    assert len(sorted_ids) == total == offsets[-1] and offsets[0] == 0
    assert total % block_size == 0 and r.expert_ids.numel() == total // block_size
    # Every kept pair exactly once; everything else is the padding index.
    kept = [i for i in range(num_pairs) if flat[i] >= 0]
    assert sorted(i for i in sorted_ids if i < num_pairs) == kept
    assert all(0 <= i <= num_pairs for i in sorted_ids)
    for e in range(num_experts):
        run = sorted_ids[offsets[e]:offsets[e + 1]]
        mine = [i for i in kept if flat[i] == e]        # in pair order
        # The run: the expert's pairs in pair order (stable), then padding up to a
        # block multiple, and no more (an expert with no pair gets no row).
        assert run == mine + [num_pairs] * (-len(mine) % block_size)
        # Each of its blocks is labelled with it; an idle expert labels no block.
        assert r.expert_ids[offsets[e] // block_size:offsets[e + 1] // block_size].eq(e).all()
        assert (e in r.expert_ids.tolist()) == bool(mine)
