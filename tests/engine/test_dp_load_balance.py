"""The data-parallel client's choice of core (vLLM 0.34's load score), without processes."""

from microvllm.engine.dp_async_llm import CoreState, least_loaded_core


def cores(*states: dict) -> list[CoreState]:
    return [CoreState(index, process=None, **state) for index, state in enumerate(states)]


def pick(all_cores: list[CoreState], start: int) -> int:
    """What DPAsyncLLM.generate does: choose, then count the request on the chosen core."""
    core = least_loaded_core(all_cores, start)
    core.in_flight += 1
    core.waiting += 1
    return core.index


def test_a_burst_takes_turns_before_any_core_reports():
    group = cores({}, {}, {})
    assert [pick(group, i % 3) for i in range(6)] == [0, 1, 2, 0, 1, 2]


def test_a_report_cannot_erase_a_request_the_core_has_not_seen():
    group = cores({"in_flight": 3}, {"in_flight": 1})
    group[0].waiting = group[0].running = 0   # core 0's report predates the three sent to it
    assert group[0].score == 3 and least_loaded_core(group).index == 1


def test_a_queue_counts_extra_only_on_a_kv_cache_over_half_full():
    roomy = cores({"waiting": 4, "running": 2, "kv_cache_usage": 0.4}, {"running": 5})
    assert roomy[0].score == 6 and least_loaded_core(roomy).index == 1
    full = cores({"waiting": 2, "running": 2, "kv_cache_usage": 1.0}, {"running": 7})
    assert full[0].score == 4 + 2 * 6 * 0.5 and least_loaded_core(full).index == 1


def test_ties_go_to_the_first_core_scanned_from_start():
    group = cores({"running": 1}, {"running": 1}, {"running": 2})
    assert least_loaded_core(group, 0).index == 0
    assert least_loaded_core(group, 1).index == 1
    assert least_loaded_core(group, 2).index == 0
