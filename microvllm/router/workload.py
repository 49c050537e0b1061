"""The workload a cache-aware router exists for, and every policy run on it.

    K system prompts of a few blocks each; many short questions after each one
    prompts (shuffled)   [ S2 | q ] [ S0 | q ] [ S2 | q ] [ S1 | q ] ...
    each replica's KV cache holds about half of the K prefixes (and the requests running)

Round robin sends every prefix to every replica, so each cache keeps evicting the prefix the
next request needs; a prefix-aware policy keeps each prefix on one replica, where it stays
cached. ``compare_policies`` runs the same prompts through each policy, on the same
replicas (their prefix caches reset in between), and returns the hit rate of each.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from microvllm.router.router import Router, RouteReport
from microvllm.sampling_params import SamplingParams

POLICY_NAMES = ("round_robin", "least_loaded", "prefix_aware", "kv_events")


@dataclass(frozen=True)
class SharedPrefixWorkload:
    prompts: list[list[int]]       # token ids, in arrival order
    prefix_of: list[int]           # which system prompt each one starts with
    num_prefixes: int
    prefix_blocks: int
    block_size: int
    num_kv_blocks: int             # per replica: about half the prefixes, plus room to run

    def as_inputs(self) -> list[dict]:
        return [{"prompt_token_ids": p} for p in self.prompts]


def shared_prefix_workload(num_prefixes: int = 6, prefix_blocks: int = 4, questions_per_prefix: int = 8, *,
                           question_tokens: tuple[int, int] = (2, 5), block_size: int = 4,
                           vocab_size: int = 512, seed: int = 0) -> SharedPrefixWorkload:
    """``num_prefixes`` system prompts of ``prefix_blocks`` full blocks each, each followed by
    ``questions_per_prefix`` questions of a few tokens, shuffled. Token ids 3.. (0-2 are the
    tiny models' special tokens). ``num_kv_blocks``: half the prefixes' blocks, plus the
    null block and room for the requests in flight."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab_size) for _ in range(prefix_blocks * block_size)]
                for _ in range(num_prefixes)]
    items = [(k, prefixes[k] + [rng.randrange(3, vocab_size) for _ in range(rng.randint(*question_tokens))])
             for k in range(num_prefixes) for _ in range(questions_per_prefix)]
    rng.shuffle(items)
    half = (num_prefixes * prefix_blocks + 1) // 2
    room = 2 * prefix_blocks           # the requests in flight: their questions' and outputs' blocks
    return SharedPrefixWorkload([p for _, p in items], [k for k, _ in items], num_prefixes, prefix_blocks,
                                block_size, num_kv_blocks=1 + half + room)


@dataclass
class PolicyComparison:
    workload: SharedPrefixWorkload
    reports: dict[str, RouteReport] = field(default_factory=dict)

    def hit_rate(self, policy: str) -> float:
        return self.reports[policy].hit_rate

    def table(self) -> str:
        w = self.workload
        lines = [f"{len(w.prompts)} requests, {w.num_prefixes} system prompts of {w.prefix_blocks} blocks "
                 f"(block_size {w.block_size}), {len(next(iter(self.reports.values())).replicas)} replicas "
                 f"of {w.num_kv_blocks} KV blocks",
                 f"{'policy':<14}{'hit rate':>9}   hit / prompt tokens   requests per replica"]
        for name, report in self.reports.items():
            per_replica = " ".join(str(r.requests) for r in report.replicas)
            lines.append(f"{name:<14}{report.hit_rate:>9.1%}   {report.hit_tokens:>5} / {report.prompt_tokens:<11}"
                         f"   {per_replica}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def make_replicas(model, num_replicas: int, workload: SharedPrefixWorkload, **llm_options) -> list:
    """``num_replicas`` LLMs on ``model`` sized for ``workload`` (its block size and KV blocks)."""
    from microvllm.llm import LLM

    options = dict(block_size=workload.block_size, num_kv_blocks=workload.num_kv_blocks, max_model_len=128,
                   max_num_seqs=8, max_num_batched_tokens=256, enforce_eager=True, **llm_options)
    return [LLM(str(model), **options) for _ in range(num_replicas)]


def compare_policies(model=None, policies: Sequence = POLICY_NAMES, *, replicas: Sequence | None = None,
                     num_replicas: int = 2, workload: SharedPrefixWorkload | None = None,
                     arrivals_per_step: int = 2, max_tokens: int = 2) -> PolicyComparison:
    """Run ``workload`` (default: ``shared_prefix_workload()``) through each policy (a name or
    a ``RoutingPolicy``) on the same replicas (``replicas``, or ``num_replicas`` new LLMs on
    ``model``), resetting their prefix caches before each; return the hit rates."""
    workload = workload or shared_prefix_workload()
    replicas = list(replicas) if replicas is not None else make_replicas(model, num_replicas, workload)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    comparison = PolicyComparison(workload)
    for policy in policies:
        for replica in replicas:
            if not replica.reset_prefix_cache():
                raise RuntimeError("a replica still runs requests: its prefix cache cannot be reset")
        router = Router(replicas, policy, arrivals_per_step=arrivals_per_step)
        report = router.route(workload.as_inputs(), params)
        comparison.reports[router.policy.name] = report
    return comparison
