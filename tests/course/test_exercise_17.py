"""Exercise 17 (moe_align_block_size: the (token, expert) pairs sorted by expert, padded to a
block): the checker passes the package's function and names the cause of each usual
mistake, crashes included (issue 54); the engine cell tells a wrong function from the right
one, ``expert_ids`` included, and puts the package's back."""

import os
import re

import pytest

import microvllm.layers.fused_moe.layer as moe_layer
import microvllm.layers.fused_moe.moe_sorted as moe_sorted
from microvllm.checks.moe_align import check_moe_align, run_moe_with
from microvllm.layers.fused_moe.moe_align_block_size import moe_align_block_size
from tests.course.mutants import moe_align_module, moe_align_mutants, mutant

MUTANTS = moe_align_mutants()
CAUSES = {   # name: words the first failure must contain (what to change)
    "unstable sort": "stable=True",
    "offsets one entry early": "one entry early",
    "padding overlaps the next expert": "expert_offsets[e] + r",
    "tokens dropped after an expert with no pairs": "does your code stop (break, return) at an expert with no pairs",
}

_COUNTS = "counts = torch.bincount(flat[kept], minlength=num_experts)"
_PADDED = "padded = (counts + block_size - 1) // block_size * block_size"
_FILL = "sorted_token_ids = torch.full((total,), num_pairs, dtype=torch.long, device=device)"
_PLACE = "sorted_token_ids[expert_offsets[experts] + rank] = order\n"
_BLOCKS = "expert_ids = torch.repeat_interleave(torch.arange(num_experts, device=device), padded // block_size)"

# The mistakes of the learner walk (issue 54, item 1), each a one-line change of the package's
# function, and what the first failure must say: its cause, not a neighbouring rule.
WALK_BUGS = {
    # counts has max(id) + 1 entries: the docstring's example (expert 3 gets no pair) crashes
    "bincount without minlength": (
        [(_COUNTS, "counts = torch.bincount(flat[kept])")],
        r"the docstring's example.*raises when the last expert \(3\) gets no pair.*"
        r"hint: +.*torch\.bincount\(ids\) returns max\(ids\) \+ 1 counts.*minlength=num_experts"),
    # 3 pairs at block_size 4 get 0 rows: the placement crashes
    "counts rounded down": (
        [(_PADDED, "padded = counts // block_size * block_size")],
        r"the docstring's example.*raises when an expert's count is not a multiple of block_size = 4.*"
        r"hint: +are the counts rounded down \(n // b \* b\)\?.*\(n \+ b - 1\) // b \* b"),
    # the padding rows hold 0, which reads as pair 0
    "padding with 0": (
        [(_FILL, "sorted_token_ids = torch.zeros(total, dtype=torch.long, device=device)")],
        r"the docstring's example.*no padding value T\*k = 6: its 6 padding rows hold 0, which reads as pair 0.*"
        r"hint: +start from a tensor filled with T\*k = 6"),
    # the token of each pair stored instead of the pair
    "token ids instead of pair ids": (
        [(_PLACE, _PLACE.replace("= order", "= order // topk_ids.shape[-1]"))],
        r"the docstring's example.*sorted_token_ids holds token ids \(pair // k\), not pair ids.*"
        r"hint: +store the pair index i"),
    # the blocks numbered 0, 1, 2, ... over the experts that got pairs: right until an expert
    # before the last gets none (not in the docstring's example, where only expert 3 does)
    "expert_ids numbered, not named": (
        [(_BLOCKS, "expert_ids = torch.repeat_interleave(torch.arange(int((padded > 0).sum()), device=device), "
                   "padded[padded > 0] // block_size)")],
        r"experts 1, 2 and 4 get no pair.*expert_ids must name the expert of each.*"
        r"hint: +your expert_ids number the experts that got pairs"),
}


def walk_mutant(name):
    return mutant(moe_align_module, WALK_BUGS[name][0]).moe_align_block_size


def test_the_package_passes():
    result = check_moe_align(moe_align_block_size, quiet=True)
    assert result.passed, result.report()


@pytest.mark.parametrize("name", sorted(CAUSES))
def test_each_mistake_is_named_by_its_cause(name):
    result = check_moe_align(MUTANTS[name], quiet=True)
    assert not result.passed and not result.not_implemented, f"the checker passed the mutant {name!r}"
    first = result.failures[0].message
    assert CAUSES[name] in first, f"{name}: the first failure does not name the cause:\n{first}"
    assert "hint:" in first and "input:" in first, first


def test_every_mutant_has_a_cause():
    assert set(MUTANTS) == set(CAUSES)


@pytest.mark.parametrize("name", WALK_BUGS)
def test_the_first_failure_names_the_walks_mistake(name):
    result = check_moe_align(walk_mutant(name), max_examples=10, quiet=True)
    assert not result.passed and not result.not_implemented, result.report()
    first = result.failures[0]
    assert re.search(WALK_BUGS[name][1], first.name + "\n" + first.message, re.S), (name, result.report())
    assert "input:" in first.message, first.message


def test_a_todo_is_reported_as_not_implemented():
    def todo(*args, **kwargs):
        raise NotImplementedError("moe_align_block_size: ...")

    result = check_moe_align(todo, quiet=True)
    assert not result.passed and result.not_implemented and "not implemented" in result.report()
    assert "not implemented yet" in run_moe_with(todo, quiet=True).message


def test_the_engine_cell_tells_a_wrong_function_from_the_right_one():
    saved = os.environ.get("MICROVLLM_MOE_IMPL")
    result = run_moe_with(moe_align_block_size, max_tokens=4, quiet=True)
    assert result.same and "calls" in result.message, result.message
    assert result.message.splitlines()[-1].startswith("✓ Same greedy tokens"), result.message
    # the run does meet experts with no pair, the case a wrong expert_ids gets wrong
    empty = int(re.search(r"(\d+) of them with an expert that got no pair", result.message).group(1))
    assert empty > 0, result.message
    # (an unstable sort gives the same tokens: the rows only move within their own expert's run)
    for name in ("padding overlaps the next expert", "offsets one entry early"):
        wrong = run_moe_with(MUTANTS[name], max_tokens=4, quiet=True)
        assert not wrong.same and "check_moe_align" in wrong.message, (name, wrong.message)
    # expert_ids is read: blocks named by position, not by expert, pass the docstring's example
    # (only its last expert gets no pair) and change the engine's tokens
    wrong = run_moe_with(walk_mutant("expert_ids numbered, not named"), max_tokens=4, quiet=True)
    assert not wrong.same and "✗ Your tokens differ" in wrong.message, wrong.message
    # the package's function, its layer table and the environment are put back
    assert moe_sorted.moe_align_block_size is moe_align_block_size
    assert moe_layer.EXPERT_FUNCTIONS["sorted"] is moe_sorted.fused_moe_sorted
    assert os.environ.get("MICROVLLM_MOE_IMPL") == saved
