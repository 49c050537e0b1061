"""vLLM's ``max_loras`` rule in the scheduler, and the adapter's key in every block hash."""

from __future__ import annotations

import pytest

from microvllm.checks.fakes import FakeRunner, FakeSamplingParams, run_steps
from microvllm.core.config import SchedulerConfig
from microvllm.core.kv_cache_manager import KVCacheManager
from microvllm.core.kv_cache_spec import FullAttentionSpec
from microvllm.core.lora_scheduling import with_max_loras
from microvllm.core.request import Request
from microvllm.core.scheduler import Scheduler
from microvllm.lora.request import LoRARequest

B = 4
A_, B_, C_ = (LoRARequest(name, i + 1, f"/adapters/{name}") for i, name in enumerate(("sql", "poem", "math")))


def request(request_id: str, prompt: list[int], lora: LoRARequest | None, max_tokens: int = 4,
            cache_salt: str | None = None) -> Request:
    return Request(request_id, prompt, FakeSamplingParams(max_tokens=max_tokens), eos_token_id=None, block_size=B,
                   cache_salt=cache_salt, lora_request=lora)


def scheduler(max_loras: int | None, max_num_seqs: int = 8):
    groups = [FullAttentionSpec(B)]
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=256)
    kv = KVCacheManager(groups, 128, B, True)
    if max_loras is None:
        return Scheduler(config, kv), FakeRunner(groups, B)
    return with_max_loras(Scheduler)(config, kv, max_loras=max_loras), FakeRunner(groups, B)


def adapters_of(records, requests) -> list[set[int]]:
    lora_of = {r.request_id: r.lora_int_id for r in requests}
    return [{lora_of[rid] for rid in record.output.num_scheduled_tokens} - {0} for record in records]


def test_at_most_max_loras_adapters_per_step_and_none_starves():
    """max_loras=2: two adapters run; a third waits (skipped, at the front of the queue),
    while requests behind it for running adapters or the base model go ahead; it runs
    once a slot's requests finish."""
    sched, runner = scheduler(max_loras=2)
    requests = [request("a", [1] * 6, A_, max_tokens=8), request("b", [2] * 6, B_, max_tokens=8),
                request("c", [3] * 6, C_, max_tokens=3), request("a2", [4] * 6, A_, max_tokens=3),
                request("base", [5] * 6, None, max_tokens=3)]
    for r in requests:
        sched.add_request(r)
    records = run_steps(sched, runner)
    per_step = adapters_of(records, requests)
    assert all(len(step) <= 2 for step in per_step), per_step
    first = records[0].output.num_scheduled_tokens
    assert set(first) == {"a", "b", "a2", "base"}, "c is skipped; those behind it are not"
    c_steps = [i for i, r in enumerate(records) if "c" in r.output.num_scheduled_tokens]
    assert c_steps, "c must run in the end"
    assert all(r.is_finished() for r in requests)
    # c starts right after the adapter that freed a slot stops running
    a_or_b_last = max(i for i, r in enumerate(records) if {"a", "b", "a2"} & set(r.output.num_scheduled_tokens)
                      and len(per_step[i]) == 2)
    assert c_steps[0] <= a_or_b_last + 1


def test_without_max_loras_nothing_is_held():
    sched, runner = scheduler(max_loras=None)
    requests = [request(str(i), [i + 1] * 5, lora) for i, lora in enumerate((A_, B_, C_))]
    for r in requests:
        sched.add_request(r)
    records = run_steps(sched, runner)
    assert len(adapters_of(records, requests)[0]) == 3


def test_held_requests_come_back_after_a_failed_plan(monkeypatch):
    """A held request goes back to its place in the queue after the plan, and after a
    plan that raised half-way too."""
    sched, _ = scheduler(max_loras=1)
    for r in (request("a", [1] * 5, A_), request("b", [2] * 5, B_), request("c", [3] * 5, None)):
        sched.add_request(r)

    def fail(*args, **kwargs):
        raise RuntimeError("a plan that fails")

    with monkeypatch.context() as patch:
        patch.setattr(sched, "_cap_new_tokens", fail)
        with pytest.raises(RuntimeError, match="a plan that fails"):
            sched.schedule()
    assert [r.request_id for r in sched.waiting] == ["a", "b", "c"]
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "c"}
    assert [r.request_id for r in sched.waiting] == ["b"]


def test_with_max_loras_keeps_a_learners_scheduler():
    class Mine(Scheduler):
        pass

    cls = with_max_loras(Mine)
    assert issubclass(cls, Mine) and with_max_loras(cls) is cls


def test_block_hashes_separate_adapters():
    prompt = list(range(3, 3 + 4 * B))
    hashes = {name: request(name, prompt, lora).block_hashes
              for name, lora in (("sql", A_), ("poem", B_), ("base", None))}
    assert len(hashes["sql"]) == 4
    for x, y in (("sql", "poem"), ("sql", "base"), ("poem", "base")):
        assert not set(hashes[x]) & set(hashes[y]), f"{x} and {y} share a block hash"
    assert request("again", prompt, A_).block_hashes == hashes["sql"]
    # the same folder under another id is the same adapter; the same name in another folder is not
    assert request("renumbered", prompt, LoRARequest("sql", 9, "/adapters/sql")).block_hashes == hashes["sql"]
    assert not set(request("moved", prompt, LoRARequest("sql", 9, "/x")).block_hashes) & set(hashes["sql"])
    # with the digest of its files (what the front end fills in): keyed by the digest alone
    first = request("d1", prompt, LoRARequest("sql", 1, "/a", lora_digest="d1")).block_hashes
    reloaded = request("d2", prompt, LoRARequest("sql", 2, "/a", lora_digest="d2")).block_hashes  # files replaced
    copy = request("copy", prompt, LoRARequest("other", 3, "/elsewhere", lora_digest="d1")).block_hashes
    assert not set(first) & set(reloaded) and not set(first) & set(hashes["sql"])
    assert copy == first
    # a cache salt that spells an adapter's name does not reach that adapter's blocks
    assert request("salted", prompt, None, cache_salt="sql").block_hashes[0] != hashes["sql"][0]

