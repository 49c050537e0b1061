"""Checks for exercise 05: ``Scheduler.schedule()``.

No model: ``FakeRunner`` plays the runner (it checks every KV read against what was
written) and samples deterministic tokens; ``run_steps`` checks the token budget,
``max_num_seqs`` and the scheduler's invariants after every step. The property test
runs random workloads (block sizes, sliding windows, budgets, pool sizes, stop rules)
and checks that every request finishes with exactly the tokens an independent replay
of the stop rules predicts, and that the pool ends fully free.
"""

from __future__ import annotations

from microvllm.checks.fakes import feeder_token, make_request, make_scheduler, outputs_by_request, run_steps
from microvllm.checks.report import (
    Case,
    CheckFailure,
    CheckResult,
    expect,
    expect_equal,
    property_settings,
    run_checks,
    run_property,
)
from microvllm.core import FullAttentionSpec, MambaSpec, PoolTooSmallError, SlidingWindowSpec

B = 4

SCHEDULER_HINTS = [
    (r"token budget", "subtract every scheduled request's tokens from token_budget and cap each "
                      "request's new tokens at what is left (self._cap_new_tokens does the capping)"),
    (r"max_num_seqs", "admit a waiting request only while len(self.running) < self.max_num_seqs"),
    (r"waiting request .* still has|both waiting and running|queued twice",
     "preempt with self._preempt(victim): it frees the blocks, resets num_computed_tokens and "
     "puts the request at the front of the waiting queue"),
    (r"handed out with the wrong content|too few for positions|null block",
     "allocate_slots(request, num_new_tokens) must succeed before a request is scheduled"),
    (r"not done after", "each step must schedule something while requests wait: running requests "
                        "first, then waiting ones (FCFS) while budget, seats and blocks last"),
]


def tokens_of(records, rid):
    return [n for r in records for n in [r.output.num_scheduled_tokens.get(rid)] if n is not None]


def generated(records, rid):
    return [t for o in outputs_by_request(records).get(rid, []) for t in o.new_token_ids]


def check_scheduler(scheduler_class, *, max_examples: int = 60, quiet: bool = False) -> CheckResult:
    """Check a ``Scheduler`` subclass (its ``schedule()``); print and return the result."""

    def scheduler(**kwargs):
        return make_scheduler(scheduler_class=scheduler_class, **kwargs)

    def chunked_prefill():
        s, runner = scheduler(max_num_batched_tokens=16)
        s.add_request(make_request("a", list(range(50)), B, max_tokens=3))
        records = run_steps(s, runner)
        expect_equal(tokens_of(records, "a"), [16, 16, 16, 2, 1, 1],
                     "a long prompt must be computed in chunks of at most the token budget",
                     input="one request: 50 prompt tokens, max_tokens=3; max_num_batched_tokens=16",
                     hint="num_new_tokens = min(tokens not yet computed, token budget left)")

    def whole_prompts_without_chunking():
        s, runner = scheduler(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
        s.add_request(make_request("a", list(range(40)), B, max_tokens=4))
        s.add_request(make_request("b", list(range(100, 164)), B, max_tokens=1))
        records = run_steps(s, runner)
        expect_equal((tokens_of(records, "a"), tokens_of(records, "b")), ([40, 1, 1, 1], [64]),
                     "with enable_chunked_prefill=False a prompt is scheduled whole, or waits",
                     input="a: 40 tokens, b: 64 tokens; budget 64, chunking off",
                     hint="if not self.enable_chunked_prefill and the prompt needs more than the "
                          "budget left: stop admitting this step (break)")

    def max_num_seqs():
        s, runner = scheduler(max_num_seqs=2, max_num_batched_tokens=64)
        for i in range(5):
            s.add_request(make_request(f"r{i}", [i] * 5, B, max_tokens=3))
        records = run_steps(s, runner)
        expect_equal(max(len(r.output.num_scheduled_tokens) for r in records), 2,
                     "at most max_num_seqs requests run at once", input="5 requests, max_num_seqs=2")

    def mixed_step():
        s, runner = scheduler(max_num_batched_tokens=10)
        s.add_request(make_request("short", [1, 2, 3], B, max_tokens=6))
        run_steps(s, runner, until_done=False, num_steps=1)
        s.add_request(make_request("long", list(range(30)), B, max_tokens=1))
        records = run_steps(s, runner)
        expect_equal(dict(records[0].output.num_scheduled_tokens), {"short": 1, "long": 9},
                     "a decode and a prefill chunk share one step's budget",
                     input="'short' decoding, then 'long' (30 tokens) arrives; budget 10",
                     hint="schedule running requests first (1 decode token), then give the rest "
                          "of the budget to waiting requests")

    def budget_with_many_requests():
        s, runner = scheduler(max_num_batched_tokens=8, max_num_seqs=4)
        for i in range(6):
            s.add_request(make_request(f"r{i}", list(range(i, i + 7)), B, max_tokens=4))
        run_steps(s, runner)  # asserts the budget every step

    def preempts_the_newest():
        s, runner = scheduler(num_blocks=7, max_num_batched_tokens=32)  # 6 usable blocks
        for rid in ("a", "b", "c", "d"):
            s.add_request(make_request(rid, [ord(rid)] * 8, B, max_tokens=10))
        records = []
        while not any(r.output.preempted_req_ids for r in records):
            expect(len(records) < 50, "no preemption although the pool is too small for 4 growing requests",
                   input="4 requests of 8 tokens, max_tokens=10; 6 usable blocks of 4")
            records += run_steps(s, runner, until_done=False, num_steps=1)
        out = records[-1].output
        what = "4 requests a, b, c, d of 8 tokens (2 blocks each) in a pool of 6 usable blocks"
        expect_equal(set(out.preempted_req_ids), {"c"},
                     "when a running request needs a block and none is free, the most recently "
                     "admitted request is preempted", input=what,
                     hint="victim = self.running.pop(); self._preempt(victim); then retry allocate_slots")
        expect_equal(out.scheduled_new_reqs, (), "a step that preempted admits no waiting request",
                     input=what, hint="skip the waiting queue when anything was preempted this step")
        expect_equal([r.request_id for r in s.waiting], ["c", "d"],
                     "the preempted request goes to the front of the waiting queue", input=what)
        records += run_steps(s, runner)
        for rid in ("a", "b", "c", "d"):
            expect_equal(generated(records, rid), [feeder_token(rid, 8 + i) for i in range(10)],
                         f"request {rid} must still produce its 10 tokens after preemption", input=what)

    def no_admission_after_preemption():
        # Caching off and a budget of 4: once b is preempted, 3 of its blocks are free and a 3-token
        # chunk of b would fit, but a step that preempted must not take blocks straight back.
        s, runner = scheduler(num_blocks=5, max_num_batched_tokens=4, enable_caching=False)
        s.add_request(make_request("a", list(range(4)), B, max_tokens=8))
        s.add_request(make_request("b", list(range(100, 108)), B, max_tokens=4))
        records = []
        while not any(r.output.preempted_req_ids for r in records):
            expect(len(records) < 50, "no preemption although a and b outgrow 4 usable blocks",
                   input="a: 4 tokens, max_tokens=8; b: 8 tokens, max_tokens=4; 4 usable blocks; budget 4")
            records += run_steps(s, runner, until_done=False, num_steps=1)
        out = records[-1].output
        expect_equal([r.req_id for r in out.scheduled_new_reqs], [],
                     "a step that preempted admits no waiting request, even one whose chunk would fit",
                     input=f"a: 4 tokens, max_tokens=8; b: 8 tokens, max_tokens=4; 4 usable blocks of 4, "
                           f"budget 4, prefix caching off; step {len(records) - 1} preempts b",
                     hint="skip the waiting queue when anything was preempted this step: admitting the "
                          "victim again at once only hands its blocks back and forth")
        run_steps(s, runner)

    def preempts_itself():
        s, runner = scheduler(num_blocks=6, max_num_batched_tokens=32)  # 5 usable blocks
        s.add_request(make_request("a", [1] * 8, B, max_tokens=6))
        s.add_request(make_request("b", [2] * 8, B, max_tokens=2))
        records = run_steps(s, runner, until_done=False, num_steps=2)
        second = records[1].output
        expect_equal((set(second.preempted_req_ids), dict(second.num_scheduled_tokens)), ({"b"}, {"a": 1}),
                     "a request that is itself the newest one left preempts itself",
                     input="a, b: 8 tokens each; 5 usable blocks; step 2: a takes the last free block",
                     hint="if the victim is the request being scheduled, stop scheduling running requests")
        run_steps(s, runner)

    def prefix_hits_at_admission():
        s, runner = scheduler()
        system = list(range(100, 116))
        a, b = make_request("a", system + [1, 2], B, max_tokens=2), make_request("b", system + [3], B, max_tokens=2)
        s.add_request(a)
        run_steps(s, runner)
        s.add_request(b)
        records = run_steps(s, runner)
        first = records[0].output
        expect_equal((dict(first.num_prefix_hit_tokens), dict(first.num_scheduled_tokens)),
                     ({"b": 16}, {"b": 1}), "a new request starts after its prefix-cache hit",
                     input="a = 16 shared tokens + 2, finished; b = the same 16 + 1",
                     hint="hit_blocks, num_hit = kv_cache_manager.get_computed_blocks(request); compute "
                          "only num_tokens - num_hit; pass both to allocate_slots; record prefix_hits")
        # RequestOutput.num_cached_tokens (and the cache-hit figures of lecture 04) read this
        expect_equal((a.num_cached_tokens, b.num_cached_tokens), (0, 16),
                     "a request records its prefix-cache hit in num_cached_tokens on first admission",
                     input="a = 16 shared tokens + 2 (no hit), finished; b = the same 16 + 1 (a 16-token hit)",
                     hint="if request.num_cached_tokens < 0 (never admitted): set it to the hit's length")

    def no_progress_raises():
        s, runner = scheduler(num_blocks=4)
        s.add_request(make_request("grows", list(range(10)), B, max_tokens=10))
        try:
            run_steps(s, runner, max_steps=10)
        except PoolTooSmallError:
            return
        except CheckFailure:
            raise
        except AssertionError as exc:
            if "not done after" not in str(exc):
                raise
        raise CheckFailure("a request that can never fit again must raise PoolTooSmallError, not spin",
                           input="10-token prompt, max_tokens=10, 3 usable blocks of 4 (12 tokens)",
                           hint="when nothing was scheduled, nothing preempted and requests wait, call "
                                "self._raise_no_progress(self.waiting[0])")

    def random_workloads():
        from hypothesis import given

        @property_settings(max_examples)
        @given(workloads())
        def test(workload):
            run_workload(workload, scheduler_class)

        run_property(test)

    cases = [
        Case("chunked prefill splits a long prompt by the token budget", chunked_prefill),
        Case("without chunked prefill a prompt is scheduled whole or waits", whole_prompts_without_chunking),
        Case("no more than max_num_seqs requests run at once", max_num_seqs),
        Case("a decode and a prefill chunk share one step", mixed_step),
        Case("six requests never exceed a budget of 8 tokens per step", budget_with_many_requests),
        Case("preemption takes the newest request, frees it, requeues it in front", preempts_the_newest),
        Case("a step that preempted admits no one, even when a chunk would fit", no_admission_after_preemption),
        Case("the request being scheduled can be the one preempted", preempts_itself),
        Case("a new request starts after its prefix-cache hit", prefix_hits_at_admission),
        Case("a request that can never fit raises instead of spinning", no_progress_raises),
        Case(f"property: {max_examples} random workloads finish with the right tokens", random_workloads),
    ]
    return run_checks("check_scheduler", cases, SCHEDULER_HINTS, quiet=quiet)


def run_workload(workload, scheduler_class=None) -> None:
    """Run one of ``workloads()``'s workloads to the end (with ``scheduler_class``, else the
    engine's ``Scheduler``); raise ``CheckFailure`` unless the pool ends fully free and
    every request got exactly the tokens and finish reason ``expected_output`` predicts.
    The checker and ``tests/core/test_scheduler.py`` both run it."""
    groups, config, requests = workload
    extra = {"scheduler_class": scheduler_class} if scheduler_class is not None else {}
    s, runner = make_scheduler(groups, **extra, **config)
    for rid, prompt, kw in requests:
        kw = dict(kw)
        s.add_request(make_request(rid, prompt, config["block_size"], eos_token_id=kw.pop("eos_token_id"), **kw))
    records = run_steps(s, runner, max_steps=2000)
    kv = s.kv_cache_manager
    where = f"config {config}, {len(groups)} cache group(s), requests {requests}"
    expect_equal(kv.block_pool.get_num_free_blocks(), kv.num_usable_blocks,
                 "every block is free again once all requests finished", input=where)
    for rid, prompt, kw in requests:
        expected = expected_output(rid, prompt, kw, config["max_model_len"])
        got = (generated(records, rid), outputs_by_request(records)[rid][-1].finish_reason)
        expect_equal(got, expected, f"request {rid}: wrong tokens or finish reason", input=where)


def workloads(kinds: tuple[str, ...] = ("full", "sliding", "hybrid")):
    """A hypothesis strategy: ``(cache groups, scheduler config, requests)`` of a random
    workload (block sizes, sliding windows, budgets, pool sizes, stop rules) in which every
    request fits the pool alone, so every request must finish. ``kinds``: which cache
    groups to draw from (``mamba_hybrid``: full attention beside a state group, its
    snapshots on or off)."""
    from hypothesis import strategies as st

    @st.composite
    def workloads(draw):
        block_size = draw(st.integers(1, 4))
        kind = draw(st.sampled_from(kinds))
        window = draw(st.integers(1, 10))
        groups = {"full": [FullAttentionSpec(block_size)], "sliding": [SlidingWindowSpec(block_size, window)],
                  "hybrid": [FullAttentionSpec(block_size), SlidingWindowSpec(block_size, window)],
                  "mamba_hybrid": [FullAttentionSpec(block_size), MambaSpec(block_size, draw(st.booleans()))],
                  }[kind]
        max_model_len = draw(st.integers(8, 40))
        requests = []
        for i in range(draw(st.integers(1, 8))):
            prefix = draw(st.sampled_from([[], [3] * 12, list(range(12))]))
            prompt = (prefix[: draw(st.integers(0, 12))]
                      + draw(st.lists(st.integers(0, 5), max_size=10)))[:max_model_len] or [1]
            params = dict(max_tokens=draw(st.integers(1, 12)), min_tokens=draw(st.integers(0, 2)),
                          eos_token_id=draw(st.sampled_from([None, 10, 11])), ignore_eos=draw(st.booleans()),
                          stop_token_ids=draw(st.sampled_from([None, [12], [13, 14]])))
            requests.append((f"r{i}", prompt, params))
        longest = max(min(len(p) + kw["max_tokens"], max_model_len + 1) for _, p, kw in requests)
        # Every request fits alone (counted as full attention), so it must finish.
        num_blocks = len(groups) * -(-longest // block_size) + 1 + draw(st.integers(0, 3))
        chunked = draw(st.booleans())
        budget = draw(st.integers(1, 24)) if chunked else max_model_len + draw(st.integers(0, 8))
        config = dict(num_blocks=num_blocks, block_size=block_size, max_num_seqs=draw(st.integers(1, 4)),
                      max_num_batched_tokens=budget, max_model_len=max_model_len, enable_chunked_prefill=chunked,
                      enable_caching=draw(st.booleans()))
        return groups, config, requests

    return workloads()


def expected_output(rid, prompt, params, max_model_len):
    """An independent replay of the stop rules over the deterministic feeder."""
    out = []
    while True:
        token = feeder_token(rid, len(prompt) + len(out))
        out.append(token)
        if len(prompt) + len(out) >= max_model_len or len(out) >= params["max_tokens"]:
            return out, "length"
        if len(out) < params["min_tokens"]:
            continue
        if (token == params["eos_token_id"] and not params["ignore_eos"]) or token in (params["stop_token_ids"] or ()):
            return out, "stop"
