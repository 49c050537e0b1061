"""The greedy argmax kernel (``csrc/argmax.cpp``) returns exactly what
``torch.argmax(dim=-1)`` returns: first maximum on ties, first NaN when a row has one,
on fresh random logits (seeded by the test's name)."""

import pytest
import torch

from microvllm.platforms.cpu import kernels, ops as cpu_kernels
from tests.attention.cases import seed_for

pytestmark = pytest.mark.skipif(kernels.status("argmax") is not None,
                                reason=f"kernel unavailable: {kernels.status('argmax')}")


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (32, 49152), (5, 17), (3, 1), (64, 1000)])
def test_equals_torch_argmax(rows, vocab, request):
    g = torch.Generator().manual_seed(seed_for(request.node.name))
    logits = torch.randn(rows, vocab, generator=g) * 5
    assert torch.equal(cpu_kernels.greedy_argmax(logits), logits.argmax(dim=-1))


def test_ties_nans_and_infinities_like_torch(request):
    g = torch.Generator().manual_seed(seed_for(request.node.name))
    logits = torch.randn(8, 100, generator=g)
    logits[0, [7, 40, 99]] = 50.0                        # a tie: the first wins
    logits[1, [3, 70]] = float("nan")                    # NaN beats everything, first one
    logits[2, 90] = float("inf")
    logits[3, :] = float("-inf")                         # all -inf: index 0
    logits[4, 97:] = 80.0                                # the maximum in the scalar tail
    logits[5, 95] = float("nan")                         # a NaN after the maximum
    logits[5, 2] = 99.0
    logits[6, :] = 0.0                                   # all equal
    logits[7, 16] = float("nan")                         # a NaN in the second vector
    got = cpu_kernels.greedy_argmax(logits)
    assert torch.equal(got, logits.argmax(dim=-1)), (got, logits.argmax(dim=-1))
    assert got[:7].tolist() == [7, 3, 90, 0, 97, 95, 0]


def test_the_samplers_argmax_op_takes_the_kernel_and_other_inputs_take_torch():
    from microvllm.sample.sampler import Argmax
    from tests.platforms.conftest import on_cpu_platform

    argmax = on_cpu_platform(Argmax())
    assert argmax.implementation == "argmax_forward"
    half = torch.randn(4, 30).to(torch.bfloat16)          # not float32: torch.argmax
    assert torch.equal(argmax(half), half.argmax(dim=-1))
    strided = torch.randn(30, 4).T                       # not contiguous: copied first
    assert torch.equal(argmax(strided), strided.argmax(dim=-1))
    empty = torch.randn(0, 30)
    assert argmax(empty).shape == (0,)
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.greedy_argmax(half)                   # the wrapper itself refuses it
