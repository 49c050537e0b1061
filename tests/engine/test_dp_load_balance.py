"""The data-parallel client's choice of core (vLLM 0.34's load score), without processes."""

from microvllm.core.outputs import EngineCoreOutput
from microvllm.core.stats import SchedulerStats
from microvllm.engine.core import EngineCoreOutputs, EngineCoreRequest
from microvllm.engine.core_client import CoreEngine, DPLBMPClient, least_loaded_core
from microvllm.sampling_params import SamplingParams


def cores(*states: dict) -> list[CoreEngine]:
    return [CoreEngine(index, process=None, **state) for index, state in enumerate(states)]


def client_over(group: list[CoreEngine]) -> DPLBMPClient:
    """A DPLBMPClient's bookkeeping over ``group``, with no process or socket behind it."""
    client = DPLBMPClient.__new__(DPLBMPClient)
    client.cores, client._scan_start, client._request_core = group, 0, {}
    return client


def request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=2), eos_token_id=None, arrival_time=0.0)


def test_a_burst_takes_turns_before_any_core_reports():
    client = client_over(cores({}, {}, {}))
    assert [client.core_for(request(f"r{i}")).index for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [core.in_flight for core in client.cores] == [2, 2, 2]


def test_a_finished_request_leaves_its_core_and_a_report_sets_the_queue():
    client = client_over(cores({}, {}))
    first, second = client.core_for(request("a")), client.core_for(request("b"))
    assert (first.index, second.index) == (0, 1) and first.waiting == 1
    client._finished(EngineCoreOutputs([EngineCoreOutput("a", (7,), finish_reason="length")]))
    assert (first.in_flight, second.in_flight) == (0, 1)
    first.report(SchedulerStats(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0))
    assert first.score == 0 and client.core_for(request("c")).index == 0
    assert client.engine_index_of("b") == 1 and client.engine_index_of("a") == 0


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
