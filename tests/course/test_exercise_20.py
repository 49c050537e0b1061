"""Exercise 20 (choose_prefix_replica: the prefix-aware router's choice): the checker passes the
package's function and names the cause of each usual mistake; the engine cell tells a wrong
one from the right one, in its own run, or says plainly what its run cannot see."""

import pytest

from microvllm.checks.prefix_router import NOT_SEEN, check_prefix_choice, run_router_with
from microvllm.router.prefix_aware import choose_prefix_replica
from tests.course.mutants import prefix_choice_mutants

MUTANTS = prefix_choice_mutants()
CAUSES = {   # name: words the first failure must contain (what to change)
    "ignores load": "load matters in three places",
    "matches the prompt's text, not the block hashes": "match request.block_hashes as they are",
    "keeps matching past the first miss": "stop counting at the first block the replica does not hold",
    "or instead of and": "Join the two comparisons with and, not or",
    ">= instead of >": "the thresholds are strict",
    ">= on the relative threshold": "the thresholds are strict",
    "ties by index, not load": "load matters in three places",
    "no overload test": "load matters in three places",
}
FIRST_CASE = {   # name: the hand case that must fail first (the one that isolates the mistake)
    "or instead of and": "one threshold crossed is not overloaded",
    ">= instead of >": "exactly at a threshold is not over it",
    ">= on the relative threshold": "exactly at a threshold is not over it",
}
# The router's tree never holds a prompt's later blocks without its first ones: no choice of
# the engine cell's run depends on counting past a miss (the checker's hand case does).
NOT_SEEN_BY_THE_ENGINE = {"keeps matching past the first miss"}


def test_the_package_passes():
    result = check_prefix_choice(choose_prefix_replica, quiet=True)
    assert result.passed, result.report()


@pytest.mark.parametrize("name", sorted(CAUSES))
def test_each_mistake_is_named_by_its_cause(name):
    result = check_prefix_choice(MUTANTS[name], quiet=True)
    assert not result.passed and not result.not_implemented, f"the checker passed the mutant {name!r}"
    first = result.failures[0].message
    assert CAUSES[name] in first, f"{name}: the first failure does not name the cause:\n{first}"
    assert "hint:" in first and "input:" in first, first
    others = {cause for cause in CAUSES.values() if cause != CAUSES[name]}
    assert not any(cause in first for cause in others), f"{name}: the first failure names another cause:\n{first}"
    if name in FIRST_CASE:
        failed = next(case for case in result.cases if case.status == "fail")
        assert failed.name.startswith(FIRST_CASE[name]), (name, failed.name)


def test_every_mutant_has_a_cause():
    assert set(MUTANTS) == set(CAUSES)


def test_a_todo_is_reported_as_not_implemented():
    def todo(*args, **kwargs):
        raise NotImplementedError("choose_prefix_replica: ...")

    result = check_prefix_choice(todo, quiet=True)
    assert not result.passed and result.not_implemented and "not implemented" in result.report()
    assert "not implemented yet" in run_router_with(todo, quiet=True).message


def test_the_engine_cell_passes_the_package_and_meets_every_rule():
    result = run_router_with(choose_prefix_replica, quiet=True)
    assert result.same and "48 calls to yours" in result.message, result.message
    assert result.message.splitlines()[-1].startswith("✓ Same greedy tokens"), result.message
    assert NOT_SEEN in result.message, result.message
    for rule in ("with no block matched", "between equal matches of unequal load", "with the best match overloaded",
                 "with one threshold crossed but not both", "exactly on a threshold"):
        assert f" 0 {rule}" not in result.message, (rule, result.message)


@pytest.mark.parametrize("name", sorted(set(MUTANTS) - NOT_SEEN_BY_THE_ENGINE))
def test_the_engine_cells_run_routes_each_mistake_differently(name):
    wrong = run_router_with(MUTANTS[name], quiet=True)
    assert not wrong.same, (name, wrong.message)
    assert wrong.reference[0] != wrong.yours[0] and "Your choices differ on" in wrong.message, (name, wrong.message)
    assert "check_prefix_choice" in wrong.message, (name, wrong.message)


@pytest.mark.parametrize("name", sorted(NOT_SEEN_BY_THE_ENGINE))
def test_the_engine_cell_says_what_its_run_cannot_see(name):
    wrong = run_router_with(MUTANTS[name], quiet=True)
    assert wrong.reference[0] == wrong.yours[0], (name, wrong.message)   # the run itself cannot tell
    assert NOT_SEEN in wrong.message and not wrong.same, (name, wrong.message)
    assert "on the docstring's example yours chooses replica 2" in wrong.message, (name, wrong.message)
