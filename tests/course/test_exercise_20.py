"""Exercise 20 (choose_prefix_replica: the prefix-aware router's choice): the checker passes the
package's function and names the cause of each usual mistake; the engine cell tells a wrong
one from the right one."""

import pytest

from microvllm.checks.prefix_router import check_prefix_choice, run_router_with
from microvllm.router.prefix_aware import choose_prefix_replica
from tests.course.mutants import prefix_choice_mutants

MUTANTS = prefix_choice_mutants()
CAUSES = {   # name: words the first failure must contain (what to change)
    "ignores load": "load matters in three places",
    "matches the prompt's text, not the block hashes": "match request.block_hashes as they are",
    "keeps matching past the first miss": "stop counting at the first block the replica does not hold",
}


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


def test_every_mutant_has_a_cause():
    assert set(MUTANTS) == set(CAUSES)


def test_a_todo_is_reported_as_not_implemented():
    def todo(*args, **kwargs):
        raise NotImplementedError("choose_prefix_replica: ...")

    result = check_prefix_choice(todo, quiet=True)
    assert not result.passed and result.not_implemented and "not implemented" in result.report()
    assert "not implemented yet" in run_router_with(todo, quiet=True).message


def test_the_engine_cell_tells_a_wrong_function_from_the_right_one():
    result = run_router_with(choose_prefix_replica, quiet=True)
    assert result.same and "48 calls to yours" in result.message, result.message
    for name in ("keeps matching past the first miss", "ignores load"):
        wrong = run_router_with(MUTANTS[name], quiet=True)
        assert not wrong.same and "check_prefix_choice" in wrong.message, (name, wrong.message)
