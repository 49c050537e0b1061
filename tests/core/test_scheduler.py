"""Scheduler: budgets, chunked prefill, preemption, prefix hits, aborts, stop rules.

No model: ``FakeRunner`` plays the runner (it checks every KV read against what
was written) and samples deterministic tokens. ``run_steps`` checks the token
budget, max_num_seqs and ``check_invariants()`` after every schedule and update.
"""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings

from microvllm.checks.scheduler import generated, run_workload, tokens_of, workloads
from microvllm.core import (
    PoolTooSmallError,
    RequestStatus,
)
from tests.core.core_helpers import feeder_token, make_request, make_scheduler, outputs_by_request, run_steps

B = 4


def finish_reason(records, rid):
    return outputs_by_request(records)[rid][-1].finish_reason


# ------------------------------------------------------------ batching


def test_chunked_prefill_splits_a_long_prompt():
    scheduler, runner = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(make_request("a", list(range(50)), B, max_tokens=3))
    records = run_steps(scheduler, runner)
    assert tokens_of(records, "a") == [16, 16, 16, 2, 1, 1]
    assert [len(r.output.scheduled_new_reqs) for r in records] == [1, 0, 0, 0, 0, 0]
    assert [len(r.engine_outputs) for r in records] == [0, 0, 0, 1, 1, 1]  # no token until the prompt is done
    assert generated(records, "a") == [feeder_token("a", p) for p in (50, 51, 52)]
    assert finish_reason(records, "a") == "length"
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler, runner = make_scheduler(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", list(range(40)), B, max_tokens=4))
    scheduler.add_request(make_request("b", list(range(100, 164)), B, max_tokens=1))
    records = run_steps(scheduler, runner)
    assert tokens_of(records, "a") == [40, 1, 1, 1]
    assert tokens_of(records, "b") == [64]  # whole, after a left room (64 > 63 while a decodes)
    assert "b" not in records[3].output.num_scheduled_tokens and "b" in records[4].output.num_scheduled_tokens


def test_chunking_off_needs_a_budget_of_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(max_num_batched_tokens=32, max_model_len=64, enable_chunked_prefill=False)


def test_max_num_seqs_is_respected():
    scheduler, runner = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", [i] * 5, B, max_tokens=3))
    records = run_steps(scheduler, runner)  # asserts <= 2 scheduled per step
    assert max(len(r.output.num_scheduled_tokens) for r in records) == 2
    assert all(len(generated(records, f"r{i}")) == 3 for i in range(5))


def test_mixed_prefill_and_decode_in_one_step():
    scheduler, runner = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("short", [1, 2, 3, 4], B, max_tokens=5))
    run_steps(scheduler, runner, until_done=False, num_steps=1)
    scheduler.add_request(make_request("long", list(range(20)), B, max_tokens=1))
    records = run_steps(scheduler, runner)
    first = records[0].output.num_scheduled_tokens
    assert dict(first) == {"short": 1, "long": 7}  # a decode and a prefill chunk share the budget
    assert records[0].output.total_num_scheduled_tokens == 8


def test_plan_is_immutable_and_reports_finished_once():
    scheduler, runner = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3], B, max_tokens=1))
    records = run_steps(scheduler, runner, until_done=False, num_steps=1)
    out = records[0].output
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.total_num_scheduled_tokens = 0
    with pytest.raises(TypeError):
        out.num_scheduled_tokens["a"] = 5
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_req_ids == {"a"}
    assert scheduler.schedule().finished_req_ids == frozenset()


# ---------------------------------------------------------- preemption


def test_preemption_picks_the_newest_frees_it_and_requeues_it_in_front():
    scheduler, runner = make_scheduler(num_blocks=7, max_num_batched_tokens=32)  # 6 usable blocks
    for rid in ("a", "b", "c", "d"):
        scheduler.add_request(make_request(rid, [ord(rid)] * 8, B, max_tokens=10))
    kv = scheduler.kv_cache_manager
    records = []
    while not any(r.output.preempted_req_ids for r in records):
        records += run_steps(scheduler, runner, until_done=False, num_steps=1)
    out = records[-1].output
    # Three prompts fit (2 blocks each), d waits; the first decode block that
    # is missing preempts c, the most recently admitted, which goes before d.
    assert out.preempted_req_ids == {"c"} and out.scheduled_new_reqs == ()
    assert "c" not in out.num_scheduled_tokens
    c = scheduler.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_output_tokens > 0
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"] and kv.get_block_ids("c") == ([],)
    records += run_steps(scheduler, runner)
    resumed = [n for r in records for n in r.output.scheduled_new_reqs if n.req_id == "c"][1]
    assert resumed.output_token_ids == tuple(c.output_token_ids[: len(resumed.output_token_ids)])
    assert len(resumed.output_token_ids) >= 1  # it keeps its outputs and recomputes them
    for rid in ("a", "b", "c", "d"):
        assert generated(records, rid) == [feeder_token(rid, 8 + i) for i in range(10)]
    assert kv.block_pool.get_num_free_blocks() == 6


def test_a_request_can_preempt_itself_and_resumes_with_prefix_hits():
    scheduler, runner = make_scheduler(num_blocks=6, max_num_batched_tokens=32)  # 5 usable blocks
    scheduler.add_request(make_request("a", [1] * 8, B, max_tokens=6))  # grows to 4 blocks
    scheduler.add_request(make_request("b", [2] * 8, B, max_tokens=2))
    records = run_steps(scheduler, runner, until_done=False, num_steps=2)
    # Step 2: a takes the last free block for position 8; b needs one too and is
    # itself the newest running request: it is preempted, not scheduled.
    second = records[1].output
    assert second.preempted_req_ids == {"b"} and dict(second.num_scheduled_tokens) == {"a": 1}
    records = run_steps(scheduler, runner)
    resume_step = next(r.output for r in records if r.output.scheduled_new_reqs)
    (resumed,) = resume_step.scheduled_new_reqs
    # a's fourth block evicted b's freed tail block (4-7); b's first block stayed cached.
    assert resumed.req_id == "b" and resumed.output_token_ids == (feeder_token("b", 8),)
    assert resumed.num_computed_tokens == 4 and resume_step.num_prefix_hit_tokens == {"b": 4}
    assert dict(resume_step.num_scheduled_tokens) == {"b": 5}  # recompute 4..8
    assert generated(records, "b") == [feeder_token("b", 9)]
    # num_cached_tokens keeps the first admission's hit count (0), not the resume's.
    assert outputs_by_request(records)["b"][-1].num_cached_tokens == 0


# ---------------------------------------------------------- prefix cache


def test_prefix_hits_are_counted_at_admission():
    scheduler, runner = make_scheduler()
    system = list(range(100, 116))
    scheduler.add_request(make_request("a", system + [1, 2], B, max_tokens=2))
    records = run_steps(scheduler, runner)
    scheduler.add_request(make_request("b", system + [3], B, max_tokens=2))
    records = run_steps(scheduler, runner)
    first = records[0].output
    assert first.num_prefix_hit_tokens == {"b": 16} and first.num_scheduled_tokens == {"b": 1}
    assert first.scheduled_new_reqs[0].num_computed_tokens == 16
    assert all(o.num_cached_tokens == 16 for o in outputs_by_request(records)["b"])


def test_no_hits_without_prefix_caching():
    scheduler, runner = make_scheduler(enable_caching=False)
    for rid in ("a", "b"):
        scheduler.add_request(make_request(rid, list(range(20)), B, max_tokens=2))
        records = run_steps(scheduler, runner)
        assert records[0].output.num_prefix_hit_tokens == {rid: 0}


# ----------------------------------------------------------------- abort


def test_abort_frees_blocks_of_running_and_waiting_requests():
    scheduler, runner = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("run", list(range(10)), B, max_tokens=50))
    scheduler.add_request(make_request("wait", list(range(10)), B, max_tokens=50))
    run_steps(scheduler, runner, until_done=False, num_steps=2)
    assert scheduler.kv_cache_manager.usage > 0
    scheduler.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    scheduler.check_invariants()
    assert not scheduler.has_unfinished_requests() and scheduler.get_num_unfinished_requests() == 0
    assert scheduler.kv_cache_manager.usage == 0.0
    assert scheduler.schedule().finished_req_ids == {"run", "wait"}


def test_abort_between_schedule_and_update_is_ignored():
    scheduler, runner = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3], B, max_tokens=5))
    out = scheduler.schedule()
    sampled = runner.execute(out)
    scheduler.finish_requests("a")
    assert scheduler.update_from_output(out, sampled) == []
    scheduler.check_invariants()


# ---------------------------------------------------------- stop rules


def run_scripted(script, **request_kwargs):
    """One request whose sampled tokens follow ``script`` (then 7, 7, ...)."""
    scheduler, runner = make_scheduler(max_model_len=request_kwargs.pop("max_model_len", 256))
    runner.sample = lambda rid, pos: script[pos - 3] if pos - 3 < len(script) else 7
    scheduler.add_request(make_request("a", [1, 2, 3], B, **request_kwargs))
    records = run_steps(scheduler, runner)
    last = outputs_by_request(records)["a"][-1]
    return generated(records, "a"), last.finish_reason, last.stop_reason


def test_stop_conditions():
    assert run_scripted([5, 6], max_tokens=4) == ([5, 6, 7, 7], "length", None)
    assert run_scripted([5, 2, 6], eos_token_id=2) == ([5, 2], "stop", None)  # EOS is kept
    assert run_scripted([5, 2, 6], eos_token_id=2, ignore_eos=True, max_tokens=4) == ([5, 2, 6, 7], "length", None)
    assert run_scripted([5, 9, 6], stop_token_ids=[9]) == ([5, 9], "stop", 9)
    assert run_scripted([2, 9, 2, 6], eos_token_id=2, stop_token_ids=[9], min_tokens=3) == ([2, 9, 2], "stop", None)
    assert run_scripted([], max_tokens=None, max_model_len=8) == ([7] * 5, "length", None)
    assert run_scripted([], max_tokens=None, max_model_len=3) == ([7], "length", None)  # prompt fills max_model_len


def test_update_requires_a_token_for_finished_prefills():
    scheduler, runner = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3], B))
    out = scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token for request 'a'"):
        scheduler.update_from_output(out, {})


# ------------------------------------------------------- refusals


def test_a_request_that_can_never_run_stalls_loudly_and_ids_are_unique():
    """Whether a prompt can ever run is checked once, before the scheduler sees it
    (``Engine.process_request``: tests/reliability/test_validation.py); one that gets here
    anyway is reported by schedule(), never spun on."""
    scheduler, runner = make_scheduler(num_blocks=4, max_model_len=64)  # 3 usable blocks = 12 tokens
    scheduler.add_request(make_request("big", list(range(13)), B))
    with pytest.raises(PoolTooSmallError, match="'big' needs 4 KV blocks for 13 tokens .* only 3 usable"):
        for _ in range(3):
            out = scheduler.schedule()
            scheduler.update_from_output(out, runner.execute(out))
    scheduler, runner = make_scheduler(num_blocks=4, max_model_len=64)
    scheduler.add_request(make_request("a", [1], B))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", [1], B))


def test_no_progress_raises_instead_of_spinning():
    scheduler, runner = make_scheduler(num_blocks=4)  # 12 tokens fit, 13 do not
    scheduler.add_request(make_request("grows", list(range(10)), B, max_tokens=10))
    with pytest.raises(PoolTooSmallError, match="request 'grows' needs 4 KV blocks for 13 tokens"):
        run_steps(scheduler, runner, max_steps=10)
    assert scheduler.requests["grows"].num_preemptions == 1


# ------------------------------------------------------ random workloads


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_with_the_pool_fully_free(workload):
    """The exercise checker's property test (microvllm.checks.scheduler), on the engine's
    Scheduler: one workload generator and one oracle, for both."""
    run_workload(workload)
