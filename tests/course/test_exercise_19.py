"""Exercise 19 (the scheduler side of a KV connector: plan_kv_load and release_finished_sends):
the package's OffloadingConnector and scheduler call them, the checker passes them and names
the cause of each usual mistake (loading blocks the local prefix cache holds, scheduling before
the load finished, freeing a block still being sent, freeing it twice), its random-arrivals
simulation alone catches them, and the engine cell (the tiny model with the in-process tier)
tells a wrong scheduler side from the right one and puts the package's back. Its workload
asks what the mistakes get wrong: prompts that end on a block boundary, a gap in the tier, a
request with every block local, reports naming a request the scheduler never delayed."""

import importlib
import re

import pytest

from microvllm.checks.kv_connector import (
    HINT_ASYNC,
    HINT_LAST,
    HINT_LOCAL,
    HINT_MISS,
    HINT_SENDING,
    HINT_TWICE,
    HINT_UNKNOWN,
    check_kv_connector,
    make_hashes,
    run_kv_tier_with,
    simulate,
)
from microvllm.checks.report import PASS, CheckFailure
from microvllm.core.scheduler_kv_connector import KVLoadPlan, plan_kv_load, release_finished_sends
from tests.course.mutants import mutant

module = importlib.import_module("microvllm.core.scheduler_kv_connector")

_FIRST = "    first = num_local_tokens // block_size"
_LAST = "    last = (num_tokens - 1) // block_size"
_RETURN = "    return KVLoadPlan(len(indices) * block_size, tuple(indices), bool(indices))"
_POP = "        blocks = kv_sending.pop(request_id, None)"
_APPEND = ("        if blocks is not None:   # reported again (or never delayed): nothing to free\n"
           "            freed.append(blocks)")

PLAN_BUGS = {   # name: (replacements, the hint the first failure must carry)
    "loads blocks the local prefix cache already holds": ([(_FIRST, "    first = 0")], HINT_LOCAL),
    "schedules before the load finished (load_async False)": (
        [(_RETURN, _RETURN.replace("bool(indices)", "False"))], HINT_ASYNC),
    "loads the last token's block": ([(_LAST, "    last = -(-num_tokens // block_size)")], HINT_LAST),
    "ends at num_tokens // block_size": ([(_LAST, "    last = num_tokens // block_size")], HINT_LAST),
    "waits with nothing to load (load_async always True)": (
        [(_RETURN, _RETURN.replace("bool(indices)", "True"))], HINT_ASYNC),
    "counts past the first miss": ([("            break                                 #", "            continue  #")],
                                   HINT_MISS),
}
RELEASE_BUGS = {
    "frees a block still being sent (every delayed free at once)": (
        [("    for request_id in sorted(finished_sending or ()):\n        blocks",
          "    for request_id in sorted(kv_sending):\n        blocks")], HINT_SENDING),
    "frees twice (reads kv_sending, does not take the entry out)": (
        [(_POP, "        blocks = kv_sending.get(request_id)")], HINT_TWICE),
    "appends None for a request kv_sending does not hold": ([(_APPEND, "        freed.append(blocks)")], HINT_UNKNOWN),
}
MUTANTS = {name: mutant(module, replacements) for name, (replacements, _) in {**PLAN_BUGS, **RELEASE_BUGS}.items()}


def functions(name):
    copy = MUTANTS[name]
    return (copy.plan_kv_load if name in PLAN_BUGS else plan_kv_load,
            copy.release_finished_sends if name in RELEASE_BUGS else release_finished_sends)


def test_the_offloading_connector_and_the_scheduler_call_them(monkeypatch):
    from microvllm.checks.kv_connector import run_kv_tier_with as run

    calls = []
    monkeypatch.setattr(module, "plan_kv_load", lambda *a: calls.append("plan") or plan_kv_load(*a))
    monkeypatch.setattr(module, "release_finished_sends", lambda *a: calls.append("free") or release_finished_sends(*a))
    # run_kv_tier_with swaps its own wrappers in and puts back what it found: ours, counted
    result = run(plan_kv_load, release_finished_sends, quiet=True)
    assert result.same, result.message
    assert "plan" in calls and "free" in calls


def test_the_docstring_example():
    h = make_hashes(16)
    assert plan_kv_load(h, 14, 4, 4, {h[0], h[1], h[2]}) == KVLoadPlan(8, (1, 2), True)
    assert plan_kv_load(h, 16, 0, 4, set(h)) == KVLoadPlan(12, (0, 1, 2), True)
    assert plan_kv_load(h, 18, 16, 4, set(h)) == KVLoadPlan(0, (), False)
    sending = {"a": (3, 4), "b": (5,)}
    assert release_finished_sends(sending, {"a", "z"}) == [(3, 4)] and sending == {"b": (5,)}
    assert release_finished_sends(sending, {"a"}) == [] and release_finished_sends(sending, None) == []


def test_the_package_passes():
    result = check_kv_connector(plan_kv_load, release_finished_sends, quiet=True)
    assert result.passed, result.report()


@pytest.mark.parametrize("name", sorted({**PLAN_BUGS, **RELEASE_BUGS}))
def test_each_mistake_is_named_by_its_cause(name):
    result = check_kv_connector(*functions(name), quiet=True)
    assert not result.passed and not result.not_implemented, f"the checker passed the mutant {name!r}"
    first = result.failures[0].message
    hint = {**PLAN_BUGS, **RELEASE_BUGS}[name][1]
    assert hint in first, f"{name}: the first failure does not name the cause:\n{first}"
    assert "hint:" in first and "input:" in first, first


@pytest.mark.parametrize("name", sorted({**PLAN_BUGS, **RELEASE_BUGS}))
def test_the_random_arrivals_alone_catch_each_mistake(name):
    with pytest.raises(CheckFailure):
        for seed in range(20):
            simulate(*functions(name), seed=seed)


def test_the_simulation_loads_and_frees():
    totals = [simulate(plan_kv_load, release_finished_sends, seed=seed) for seed in range(5)]
    assert all(t["loads"] > 0 and t["blocks_loaded"] > 0 and t["freed"] > 0 for t in totals), totals


def test_a_todo_is_reported_as_not_implemented():
    def todo(*args, **kwargs):
        raise NotImplementedError("plan_kv_load: ...")

    result = check_kv_connector(todo, release_finished_sends, quiet=True)
    assert not result.passed and result.not_implemented and "not implemented" in result.report()
    assert "not implemented yet" in run_kv_tier_with(todo, release_finished_sends, quiet=True).message


def test_the_engine_cell_tells_a_wrong_scheduler_side_from_the_right_one():
    result = run_kv_tier_with(plan_kv_load, release_finished_sends, quiet=True)
    assert result.same and "✓ identical" in result.message, result.message
    assert "✓ Same greedy tokens, prefix-cache hits and tier loads as the package's" in result.message
    assert "(12 calls to your plan_kv_load" in result.message, result.message
    # the example already fails this one: told before the engine starts
    early = run_kv_tier_with(*functions("loads blocks the local prefix cache already holds"), quiet=True)
    assert not early.same and "check_kv_connector" in early.message, early.message

    def schedules_long_prompts_at_once(block_hashes, *args):   # right on the example (4 blocks), not past it
        plan = plan_kv_load(block_hashes, *args)
        return KVLoadPlan(plan.num_external_tokens, plan.block_indices, len(block_hashes) <= 4 and plan.load_async)

    late = run_kv_tier_with(schedules_long_prompts_at_once, release_finished_sends, quiet=True)
    assert not late.same and "load_async=False" in late.message, late.message
    assert module.plan_kv_load is plan_kv_load and module.release_finished_sends is release_finished_sends


def test_the_packages_functions_are_put_back_after_an_error():
    h = make_hashes(16)

    def broken(block_hashes, *args):
        if block_hashes is not h and len(block_hashes) > 4:   # passes the example, fails in the engine
            raise RuntimeError("broken on purpose")
        return plan_kv_load(block_hashes, *args)

    result = run_kv_tier_with(broken, release_finished_sends, quiet=True)
    assert not result.same and "broken on purpose" in result.message, result.message
    assert module.plan_kv_load is plan_kv_load


def test_the_engine_cells_pre_check_is_the_checkers_example():
    """The engine cell first runs the contract's example: the checker's own first case, on the
    same store (it once used a store holding every block, and called a plan that passes the
    checker's example one that fails it)."""
    wrong = functions("loads the last token's block")   # right on the example, wrong past it
    checked = check_kv_connector(*wrong, quiet=True)
    assert checked.cases[0].status == PASS and not checked.passed, checked.report()
    result = run_kv_tier_with(*wrong, quiet=True)
    assert not result.same and "example" not in result.message, result.message
    # caught by the engine itself: a third of the prompts end on a block boundary
    assert "leave the last token to be computed" in result.message, result.message


def test_a_none_for_a_request_never_delayed_is_named_by_its_own_case():
    """It used to be first caught by the second report of a request, with the hint about
    freeing requests still being sent: the wrong cause."""
    result = check_kv_connector(*functions("appends None for a request kv_sending does not hold"), quiet=True)
    first = result.failures[0]
    assert first.name == "a reported request kv_sending does not hold frees nothing", result.report()
    assert re.search(r"finished_sending = \['z'\].*got: +\[None\].*never its None", first.message, re.S), first.message
    assert HINT_SENDING not in first.message, first.message


def test_the_engine_cells_workload_asks_what_the_mistakes_get_wrong():
    message = run_kv_tier_with(plan_kv_load, release_finished_sends, quiet=True).message
    calls = re.search(r"the calls: (\d+) plans past a gap in the tier .*?, (\d+) with every block local .*?, "
                      r"(\d+) reports of finished sends, each also naming 'never-delayed'", message)
    assert calls and all(int(count) > 0 for count in calls.groups()), message
    loaded = re.search(r"tier blocks loaded: yours (\d+)", message)
    assert loaded and int(loaded.group(1)) > 0, message


ENGINE_OUTCOMES = {   # mutant: what the engine cell must say (and it must not pass it)
    "ends at num_tokens // block_size": r"KVConnectorContractError: .*leave the last token to be computed",
    "counts past the first miss": r"KeyError.*Your plan skipped a block and offered later ones",
    "waits with nothing to load (load_async always True)":
        r"✗ \d+ of your plans offered nothing and said load_async=True.*its tokens cannot show it",
    "appends None for a request kv_sending does not hold":
        r"'NoneType' object has no attribute 'blocks'.*returned None among the freed block lists",
}


@pytest.mark.parametrize("name", sorted(ENGINE_OUTCOMES))
def test_the_engine_cell_catches_each_mistake_past_its_pre_check(name):
    wrong = functions(name)
    result = run_kv_tier_with(*wrong, quiet=True)
    assert not result.same, result.message
    assert "example" not in result.message, result.message   # the engine itself, not the pre-check
    assert re.search(ENGINE_OUTCOMES[name], result.message, re.S), result.message
    assert "✓ Same greedy tokens" not in result.message, result.message
    assert module.plan_kv_load is plan_kv_load and module.release_finished_sends is release_finished_sends
