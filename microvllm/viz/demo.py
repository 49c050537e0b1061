"""Small recorded traces for tests and notebooks, made by the real scheduler without a model.

    demo_trace("prefix")          shared system prompt: shared blocks, cached-free blocks, hits
    demo_trace("preemption")      a pool too small for everyone: preemption, recompute, hits
    demo_trace("sliding_window")  window of 8 tokens: old blocks become the null block
    demo_trace("chunked")         long prompts under a small budget: mixed prefill + decode steps
    large_demo_trace()            hundreds of steps and blocks, for timing the explorer

`simulate` drives the engine's own `Scheduler` + `KVCacheManager` (microvllm.core)
and records every step with the engine's `StepTracer`; only the model is missing.
It plays the runner: a request whose known tokens are all computed "samples" a
seeded random token id (or the eos id, to end it with "stop")::

    arrivals -> Scheduler.schedule() -> fake sampled ids -> update_from_output() -> StepTracer

So the block accounting, prefix hits, preemptions and sliding windows in these
traces are exactly what the engine would do; every trace passes
`Trace.check_consistency()`.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from microvllm.core import FullAttentionSpec, KVCacheManager, Request, Scheduler, SchedulerConfig, SlidingWindowSpec
from microvllm.engine.step_tracer import StepTracer
from microvllm.sampling_params import SamplingParams
from microvllm.trace import Trace

KINDS = ("prefix", "preemption", "sliding_window", "chunked")
EOS_TOKEN_ID = 2                     # fake sampled ids are 100..999, prompt ids 1000 and up

SYSTEM = "You are a helpful assistant . Answer in one short sentence ."
QUESTIONS = [
    "What is a KV cache ?",
    "Why do we page the KV cache into blocks ?",
    "How does a prefix cache find a hit ?",
    "What is continuous batching ?",
    "Why is the last prompt token always recomputed ?",
    "What happens to a preempted request ?",
]


@dataclass(frozen=True)
class Arrival:
    """A request of the simulation: it joins the waiting queue at ``arrival_step``.

    ``finish_reason`` "length" ends it after ``max_tokens`` outputs; "stop" makes
    its ``max_tokens``-th output the eos id (as a model ending its answer would).
    """

    request_id: str
    prompt: str
    max_tokens: int
    arrival_step: int = 0
    finish_reason: str = "length"


class _Vocab:
    """Words -> token ids, so equal text gives equal ids (and equal block hashes)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.ids.setdefault(word, 1000 + len(self.ids)) for word in text.split()]


def simulate(arrivals: list[Arrival], *, block_size: int, num_blocks: int, max_num_batched_tokens: int,
             max_num_seqs: int, sliding_window: int | None = None, hybrid: bool = False,
             enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True, seed: int = 0,
             max_steps: int = 10_000) -> Trace:
    """Run the real scheduler over ``arrivals`` with fake sampled tokens; return its trace.

    ``sliding_window``: every cache group is a sliding window of that many tokens,
    or with ``hybrid=True`` a full-attention group plus a sliding-window group.
    When nothing is left to run, the next request arrives at once (no idle steps).
    """
    if hybrid and sliding_window is None:
        raise ValueError("hybrid=True needs a sliding_window")
    specs = [SlidingWindowSpec(block_size, sliding_window)] if sliding_window else [FullAttentionSpec(block_size)]
    if hybrid:
        specs.insert(0, FullAttentionSpec(block_size))
    vocab = _Vocab()
    prompts = {a.request_id: vocab.encode(a.prompt) for a in arrivals}
    max_model_len = max(len(prompts[a.request_id]) + a.max_tokens for a in arrivals) + 1
    scheduler = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill),
                          KVCacheManager(specs, num_blocks, block_size, enable_caching=enable_prefix_caching))
    tracer = StepTracer(scheduler)
    rng = random.Random(seed)
    pending = deque(sorted(arrivals, key=lambda a: a.arrival_step))
    stops_at = {a.request_id: a.max_tokens for a in arrivals if a.finish_reason == "stop"}
    for step in range(max_steps):
        if not (pending or scheduler.has_unfinished_requests()):
            return tracer.trace
        while pending and (pending[0].arrival_step <= step or not scheduler.has_unfinished_requests()):
            a = pending.popleft()
            # A "stop" request may run one token past its eos, so "length" never comes first.
            params = SamplingParams(max_tokens=a.max_tokens + (a.request_id in stops_at))
            scheduler.add_request(Request(a.request_id, prompts[a.request_id], params,
                                          eos_token_id=EOS_TOKEN_ID, block_size=block_size))
            tracer.add_prompt(a.request_id, a.prompt)
        plan = scheduler.schedule()
        scheduled = tracer.begin(plan)
        sampled = {}                  # the runner's part: sample once all known tokens are computed
        for rid in plan.num_scheduled_tokens:
            request = scheduler.requests[rid]
            if request.num_computed_tokens == request.num_tokens:
                ends = request.num_output_tokens + 1 == stops_at.get(rid)
                sampled[rid] = [EOS_TOKEN_ID if ends else rng.randrange(100, 1000)]
        core_outputs = scheduler.update_from_output(plan, sampled)
        tracer.record(plan, scheduled, core_outputs, [], step)
        scheduler.check_invariants()
    raise RuntimeError(f"simulation not finished after {max_steps} steps")


def demo_trace(kind: str = "prefix", *, hybrid: bool = False, seed: int = 0) -> Trace:
    """A small, internally consistent trace showing one idea (see module docstring).

    ``hybrid=True`` (sliding_window only) gives two cache groups, full attention
    plus sliding window, like models that interleave both kinds of layer.
    """
    if kind == "prefix":
        arrivals = [Arrival("r0", f"{SYSTEM} {QUESTIONS[0]}", 6, 0),
                    Arrival("r1", f"{SYSTEM} {QUESTIONS[1]}", 5, 2, "stop"),
                    Arrival("r2", "Translate to French : the cat sleeps", 4, 3),
                    Arrival("r3", f"{SYSTEM} {QUESTIONS[2]}", 5, 11)]
        settings = dict(block_size=4, num_blocks=24, max_num_batched_tokens=32, max_num_seqs=4)
    elif kind == "preemption":
        arrivals = [Arrival(f"r{i}", f"{SYSTEM} {QUESTIONS[i]}", 14, i // 2) for i in range(4)]
        settings = dict(block_size=4, num_blocks=16, max_num_batched_tokens=32, max_num_seqs=4)
    elif kind == "sliding_window":
        arrivals = [Arrival("r0", QUESTIONS[0], 18, 0), Arrival("r1", QUESTIONS[3], 14, 1),
                    Arrival("r2", QUESTIONS[4], 8, 3)]
        settings = dict(block_size=4, num_blocks=32 if hybrid else 20, max_num_batched_tokens=32,
                        max_num_seqs=4, sliding_window=8, hybrid=hybrid)
    elif kind == "chunked":
        long_text = f"{SYSTEM} {QUESTIONS[1]} {QUESTIONS[4]}"
        arrivals = [Arrival("r0", QUESTIONS[3], 8, 0), Arrival("r1", long_text, 4, 1),
                    Arrival("r2", QUESTIONS[5], 4, 2)]
        settings = dict(block_size=4, num_blocks=32, max_num_batched_tokens=10, max_num_seqs=4)
    else:
        raise ValueError(f"unknown demo trace kind {kind!r}: choose one of {KINDS}")
    if hybrid and kind != "sliding_window":
        raise ValueError("hybrid=True only applies to demo_trace('sliding_window')")
    return simulate(arrivals, seed=seed, **settings)


def large_demo_trace(num_requests: int = 100, num_blocks: int = 256, *, block_size: int = 8,
                     max_num_batched_tokens: int = 128, max_num_seqs: int = 32, arrival_every: int = 2,
                     seed: int = 0) -> Trace:
    """Hundreds of steps over a pool of hundreds of blocks: random prompts sharing prefixes."""
    rng = random.Random(seed)
    arrivals = []
    for i in range(num_requests):
        text = f"{SYSTEM} {rng.choice(QUESTIONS)} " + " ".join(
            f"w{rng.randrange(500)}" for _ in range(rng.randrange(4, 60)))
        arrivals.append(Arrival(f"r{i}", text, rng.randrange(16, 96), i * arrival_every))
    return simulate(arrivals, block_size=block_size, num_blocks=num_blocks,
                    max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, seed=seed)
