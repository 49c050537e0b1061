"""Exercise 22's checker on ops a learner might write from scratch, not planted one line at a
time: a loop and an einsum that are right pass; the wrong ones are failed (not reported as
unfinished) and their first failure gives the hint of their real mistake."""

from __future__ import annotations

import torch

from microvllm.checks.lora_batch import (
    HINT_IN_PLACE,
    HINT_ROWS,
    HINT_SLOT_LAST,
    HINT_SLOT_ZERO,
    check_lora_batch,
)
from microvllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink


def first_failure(shrink, expand) -> tuple[str, str]:
    """(the name of the first failing case, its explanation)."""
    result = check_lora_batch(shrink, expand, max_examples=20, quiet=True)
    assert not result.passed and not result.not_implemented, result.report()
    case = next(case for case in result.cases if case.status == "fail")
    return case.name, case.message


def loop_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
    """Right, but a Python loop over tokens."""
    for t, slot in enumerate(lora_indices_tensor.tolist()):
        output_tensor[t] = scaling * (lora_a_weights[slot].to(inputs.dtype) @ inputs[t]) if slot >= 0 else 0


def einsum_shrink_unmasked(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
    """Gathers with the slots as they are: -1 picks the last slot."""
    selected = lora_a_weights[lora_indices_tensor].to(inputs.dtype)
    output_tensor.copy_(scaling * torch.einsum("tri,ti->tr", selected, inputs))


def einsum_expand_clamped(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,
                          add_inputs=True):
    """Clamps -1 to slot 0 and forgets the mask."""
    selected = lora_b_weights[lora_indices_tensor.clamp(min=0)].to(inputs.dtype)
    out = torch.einsum("tor,tr->to", selected, inputs).to(output_tensor.dtype)
    target = output_tensor[:, slice_offset:slice_offset + slice_size]
    if add_inputs:
        target += out
    else:
        target.copy_(out)


def returns_the_result(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
    """Computes the right h, returns it, and never writes output_tensor."""
    h = torch.zeros_like(output_tensor)
    bgmv_shrink(inputs, lora_a_weights, h, lora_indices_tensor, scaling)
    return h


def scaling_twice_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
    """Multiplies by the scaling twice: no usual mistake gives its answer."""
    bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling * scaling)


def test_a_loop_over_tokens_passes():
    result = check_lora_batch(loop_shrink, bgmv_expand_slice, max_examples=20, quiet=True)
    assert result.passed, result.report()


def test_indexing_with_minus_one_is_the_last_slot():
    name, message = first_failure(einsum_shrink_unmasked, bgmv_expand_slice)
    assert name.startswith("shrink: slot -1"), name
    assert HINT_SLOT_LAST in message, message


def test_a_clamp_without_a_mask_is_slot_zero():
    name, message = first_failure(bgmv_shrink, einsum_expand_clamped)
    assert name.startswith("expand: slot -1"), name
    assert HINT_SLOT_ZERO in message, message


def test_a_result_returned_instead_of_written():
    name, message = first_failure(returns_the_result, bgmv_expand_slice)
    assert name.startswith("shrink: A @ x"), name
    assert HINT_IN_PLACE in message and "was not written" in message, message


def test_a_mistake_the_checker_does_not_know_still_gets_a_hint():
    name, message = first_failure(scaling_twice_shrink, bgmv_expand_slice)
    assert name.startswith("shrink: the scaling multiplies the result"), name
    assert HINT_ROWS.split("{")[0] in message and "hint:" in message, message
