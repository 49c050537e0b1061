"""Exercise 17 (moe_align_block_size: the (token, expert) pairs sorted by expert, padded to a
block): the checker passes the package's function and names the cause of each usual
mistake; the engine cell tells a wrong one from the right one and puts the package's back."""

import os

import pytest

import microvllm.layers.fused_moe.layer as moe_layer
import microvllm.layers.fused_moe.moe_sorted as moe_sorted
from microvllm.checks.moe_align import check_moe_align, run_moe_with
from microvllm.layers.fused_moe.moe_align_block_size import moe_align_block_size
from tests.course.mutants import moe_align_mutants

MUTANTS = moe_align_mutants()
CAUSES = {   # name: words the first failure must contain (what to change)
    "unstable sort": "stable=True",
    "offsets one entry early": "one entry early",
    "padding overlaps the next expert": "expert_offsets[e] + r",
    "tokens dropped after an expert with no pairs": "does your code stop (break, return) at an expert with no pairs",
}


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
    # (an unstable sort gives the same tokens: the rows only move within their own expert's run)
    for name in ("padding overlaps the next expert", "offsets one entry early"):
        wrong = run_moe_with(MUTANTS[name], max_tokens=4, quiet=True)
        assert not wrong.same and "check_moe_align" in wrong.message, (name, wrong.message)
    # the package's function, its layer table and the environment are put back
    assert moe_sorted.moe_align_block_size is moe_align_block_size
    assert moe_layer.EXPERT_FUNCTIONS["sorted"] is moe_sorted.fused_moe_sorted
    assert os.environ.get("MICROVLLM_MOE_IMPL") == saved
