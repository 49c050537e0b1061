"""The Triton LoRA kernels (``lora_shrink``, ``lora_expand``) against the torch reference
(``bgmv_shrink``, ``bgmv_expand_slice``), on a CPU through Triton's interpreter
(TRITON_INTERPRET=1, set in tests/conftest.py); skipped where triton is not installed.

Every case builds fresh random inputs from a generator seeded with the test's name.
Sizes are small (the interpreter runs one program at a time) but hit the edges: T = 1,
T not a multiple of BLOCK_M = 16, hidden sizes that are not multiples of the tiles,
rank 1, adapters with no token, batches with no adapter at all and with no -1, tokens
of different adapters interleaved.

Tolerances (outputs are O(1): weights are scaled by 1/sqrt(fan-in)). Both sides
multiply the same numbers; they differ in the order of the additions and in where they
round: the reference rounds each matmul to the input dtype, then the scaling, then the
sum with the output; the kernel accumulates in float32 and rounds once.
    float32:  1e-5 (observed: 6e-7 at |value| ~ 1).
    float16:  2e-3 relative and absolute: 2 ulps at |value| ~ 1 (observed: 1 ulp).
    bfloat16: rtol 2e-2, atol 3e-2: ~2.5 ulps (8 significant bits); the interpreter also
              rounds float32 -> bfloat16 towards zero (observed: 1.5 ulps).
(Observed over the cases below with four seeds each, in Triton 3.7's interpreter.)
"""

from __future__ import annotations

import importlib.util
import zlib

import pytest
import torch

# Not pytest.importorskip: that would import triton, and triton must be imported only
# after the kernels' module has switched the interpreter on (ensure_triton_can_run).
if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package (Linux)", allow_module_level=True)

from microvllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink  # noqa: E402
from microvllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5),
             torch.float16: dict(rtol=2e-3, atol=2e-3),
             torch.bfloat16: dict(rtol=2e-2, atol=3e-2)}

# name: (T, hidden, slice sizes of the merged output, max_loras, max_rank, mix)
CASES = {
    "one-token": (1, 40, [24], 2, 8, "adapters only"),
    "ragged": (37, 72, [48, 16, 16], 3, 16, "mixed"),      # q, k, v of different widths
    "long": (70, 24, [40], 4, 8, "mixed"),                 # 5 blocks of 16 tokens
    "rank-1": (17, 40, [24, 24], 2, 1, "mixed"),
    "no-adapter": (9, 40, [24], 2, 8, "none"),             # every token -1
    "interleaved": (20, 32, [16, 48], 4, 16, "interleaved"),  # 0 1 2 3 0 1 2 3 ...: worst order
    "one-slot": (16, 40, [24], 1, 16, "adapters only"),
    "idle-slots": (12, 40, [24], 4, 8, "only 2"),          # slots 0, 1 and 3 get no token
}


def generator(name: str) -> torch.Generator:
    """A generator seeded from the test's name: different numbers per test, same per run."""
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def make_mapping(g: torch.Generator, num_tokens: int, max_loras: int, mix: str) -> torch.Tensor:
    if mix == "mixed":        # -1 and every slot, in random order
        mapping = torch.randint(-1, max_loras, (num_tokens,), generator=g)
        mapping[0] = -1
    elif mix == "adapters only":
        mapping = torch.randint(0, max_loras, (num_tokens,), generator=g)
    elif mix == "none":
        mapping = torch.full((num_tokens,), -1)
    elif mix == "interleaved":
        mapping = torch.arange(num_tokens) % max_loras
    else:                     # "only S": one slot, and -1
        mapping = torch.where(torch.rand(num_tokens, generator=g) < 0.7, int(mix.split()[1]), -1)
    return mapping.to(DEVICE)


def make_case(name: str, case: str, dtype: torch.dtype):
    """``(mapping, x, lora_a, lora_bs, slice sizes)``; one lora_b per slice."""
    num_tokens, hidden, sizes, max_loras, rank, mix = CASES[case]
    g = generator(name)
    mapping = make_mapping(g, num_tokens, max_loras, mix)
    x = torch.randn(num_tokens, hidden, generator=g)
    lora_a = torch.randn(max_loras, rank, hidden, generator=g) / hidden ** 0.5
    lora_bs = [torch.randn(max_loras, size, rank, generator=g) / rank ** 0.5 for size in sizes]
    return (mapping, x.to(DEVICE, dtype), lora_a.to(DEVICE, dtype),
            [b.to(DEVICE, dtype) for b in lora_bs], sizes)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES)
def test_shrink_matches_reference(case, dtype):
    mapping, x, lora_a, _, _ = make_case(f"shrink/{case}", case, dtype)
    scaling = 0.5 if case != "rank-1" else 2.0
    # Start from garbage: every row must be written, zeros included.
    out = torch.full((x.shape[0], lora_a.shape[1]), 123.0, dtype=dtype, device=DEVICE)
    expected = torch.empty_like(out)
    lora_shrink(x, lora_a, out, LoRAKernelMeta.prepare(mapping), scaling)
    bgmv_shrink(x, lora_a, expected, mapping, scaling)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    assert torch.equal(out[mapping < 0], torch.zeros_like(out[mapping < 0]))


@pytest.mark.parametrize("add_inputs", [True, False], ids=["add", "overwrite"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES)
def test_expand_matches_reference(case, dtype, add_inputs):
    """Each slice of a merged layer's output in turn; columns outside the slice untouched."""
    mapping, x, _, lora_bs, sizes = make_case(f"expand/{case}", case, dtype)
    g = generator(f"expand/{case}/inputs")
    h = torch.randn(x.shape[0], lora_bs[0].shape[2], generator=g).to(DEVICE, dtype)
    base = torch.randn(x.shape[0], sum(sizes), generator=g).to(DEVICE, dtype)   # the base layer's y
    meta = LoRAKernelMeta.prepare(mapping)
    offset = 0
    for lora_b, size in zip(lora_bs, sizes):
        out, expected = base.clone(), base.clone()
        lora_expand(h, lora_b, out, meta, offset, add_inputs)
        bgmv_expand_slice(h, lora_b, expected, mapping, offset, size, add_inputs)
        assert out.shape == base.shape and out.dtype == dtype
        torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
        outside = torch.ones(sum(sizes), dtype=torch.bool, device=DEVICE)
        outside[offset:offset + size] = False
        assert torch.equal(out[:, outside], base[:, outside])
        if add_inputs:   # a token without an adapter gets exactly the base layer's output
            assert torch.equal(out[mapping < 0], base[mapping < 0])
        offset += size


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_float32_intermediate(dtype):
    """vLLM's layout: half-precision x, weights and y, with h in a float32 buffer. Shrink
    writes float32; expand reads float32 h and half-precision weights (widened, as the
    reference does) and writes half precision."""
    mapping, x, lora_a, lora_bs, sizes = make_case("mixed-dtypes", "ragged", dtype)
    meta = LoRAKernelMeta.prepare(mapping)
    h = torch.empty(x.shape[0], lora_a.shape[1], device=DEVICE)
    expected_h = torch.empty_like(h)
    lora_shrink(x, lora_a, h, meta, 0.5)
    bgmv_shrink(x, lora_a, expected_h, mapping, 0.5)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h, expected_h, **TOLERANCE[dtype])
    base = torch.randn(x.shape[0], sum(sizes), generator=generator("mixed-dtypes/base")).to(DEVICE, dtype)
    out, expected = base.clone(), base.clone()
    lora_expand(expected_h, lora_bs[0], out, meta, 0, add_inputs=True)
    bgmv_expand_slice(expected_h, lora_bs[0], expected, mapping, 0, sizes[0], add_inputs=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("case", ["ragged", "interleaved", "one-token"])
def test_shrink_then_expand_equals_per_token_loop(case):
    """The whole LoRA update, against a plain loop over tokens with each adapter at its own
    rank: ranks below max_rank are zero-padded in the stacked weights and add nothing."""
    mapping, x, _, _, sizes = make_case(f"pipeline/{case}", case, torch.float32)
    num_tokens, hidden, _, max_loras, max_rank, _ = CASES[case]
    g = generator(f"pipeline/{case}/adapters")
    ranks = [max(1, max_rank >> i) for i in range(max_loras)]          # e.g. 16, 8, 4
    adapters = [(torch.randn(r, hidden, generator=g) / hidden ** 0.5,
                 torch.randn(sum(sizes), r, generator=g) / r ** 0.5) for r in ranks]
    lora_a = torch.zeros(max_loras, max_rank, hidden)
    lora_b = torch.zeros(max_loras, sum(sizes), max_rank)
    for slot, (a, b) in enumerate(adapters):
        lora_a[slot, :a.shape[0]] = a
        lora_b[slot, :, :b.shape[1]] = b
    base = torch.randn(num_tokens, sum(sizes), generator=g)
    scaling = 0.25

    meta = LoRAKernelMeta.prepare(mapping)
    h = torch.empty(num_tokens, max_rank, device=DEVICE)
    y = base.to(DEVICE).clone()
    lora_shrink(x, lora_a.to(DEVICE), h, meta, scaling)
    lora_expand(h, lora_b.to(DEVICE), y, meta, 0, add_inputs=True)

    expected = base.clone()
    for t, slot in enumerate(mapping.tolist()):
        if slot >= 0:
            a, b = adapters[slot]
            expected[t] += b @ (scaling * (a @ x[t].cpu()))
    torch.testing.assert_close(y.cpu(), expected, **TOLERANCE[torch.float32])


def test_metadata_of_the_docstring_example():
    meta = LoRAKernelMeta.prepare(torch.tensor([1, -1, 0, 1, 1, -1, 0]))
    assert meta.token_indices_sorted_by_lora_ids.tolist() == [1, 5, 2, 6, 0, 3, 4]
    assert meta.active_lora_ids.tolist() == [-1, 0, 1]
    assert meta.num_tokens_per_lora.tolist() == [2, 2, 3]
    assert meta.lora_token_start_loc.tolist() == [0, 2, 4, 7]


@pytest.mark.parametrize("seed", range(5))
def test_metadata_groups_tokens_by_adapter(seed):
    g = torch.Generator().manual_seed(seed)
    num_tokens = int(torch.randint(1, 70, (1,), generator=g))
    mapping = torch.randint(-1, 4, (num_tokens,), generator=g)
    meta = LoRAKernelMeta.prepare(mapping)
    order = meta.token_indices_sorted_by_lora_ids.long()
    assert sorted(order.tolist()) == list(range(num_tokens))          # a permutation
    assert meta.active_lora_ids.tolist() == sorted(set(mapping.tolist()))
    start = meta.lora_token_start_loc.tolist()
    assert start[0] == 0 and start[-1] == num_tokens
    for s, lora in enumerate(meta.active_lora_ids.tolist()):
        segment = order[start[s]:start[s + 1]]
        assert len(segment) == meta.num_tokens_per_lora[s] > 0
        assert (mapping[segment] == lora).all()                       # one adapter per segment
        assert segment.tolist() == sorted(segment.tolist())           # batch order kept


def test_empty_batch_writes_nothing():
    meta = LoRAKernelMeta.prepare(torch.empty(0, dtype=torch.long, device=DEVICE))
    out = torch.empty(0, 8, device=DEVICE)
    lora_shrink(torch.empty(0, 32, device=DEVICE), torch.randn(2, 8, 32, device=DEVICE), out, meta)
    lora_expand(out, torch.randn(2, 16, 8, device=DEVICE), torch.empty(0, 16, device=DEVICE), meta)


def test_bad_input_says_what_to_change():
    meta = LoRAKernelMeta.prepare(torch.tensor([0, 2, -1], device=DEVICE))
    x, h = torch.randn(3, 32, device=DEVICE), torch.empty(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="out of range for 2 slots"):
        lora_shrink(x, torch.randn(2, 8, 32, device=DEVICE), h, meta)
    with pytest.raises(ValueError, match="must be equal"):
        lora_shrink(x, torch.randn(3, 8, 16, device=DEVICE), h, meta)
    with pytest.raises(ValueError, match="same tokens"):
        lora_shrink(x[:2], torch.randn(3, 8, 32, device=DEVICE), h[:2], meta)
    with pytest.raises(ValueError, match="does not fit"):
        lora_expand(h, torch.randn(3, 16, 8, device=DEVICE), torch.empty(3, 24, device=DEVICE), meta, 16)
    with pytest.raises(ValueError, match="1-D"):
        LoRAKernelMeta.prepare(torch.zeros(2, 3, dtype=torch.long))
