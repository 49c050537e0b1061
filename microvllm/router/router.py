"""Router: N engine replicas in one process, a policy choosing one for each request.

    router = Router([LLM(model, ...), LLM(model, ...)], "prefix_aware")
    report = router.route(prompts, SamplingParams(max_tokens=4))

    route():  prompts arrive ``arrivals_per_step`` at a time
       for each arrival:  RoutedRequest (tokens, block hashes: the engine's chain)
                          ReplicaState per replica (requests running / waiting, KV usage)
                          policy.choose(...) -> Choice(replica, reason)
                          engine[replica].add_processed_request(...)
       then every replica with work runs one step(); with the kv_events policy the
       block pools' changes are fed to it; repeat until every request finished.

The report says, per replica, how many requests it served and how many of their prompt
tokens came from its prefix cache (``RequestOutput.num_cached_tokens``), and for every
request where it went and why. The replicas are ``LLM`` or ``Engine`` objects on the same
model and block size (a data-parallel deployment's replicas); the router tokenizes with
the first one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from microvllm.engine.metrics import engine_metrics
from microvllm.router.kv_events import BlockPoolPoller, KVEventsPolicy
from microvllm.router.policies import make_policy
from microvllm.router.policy import ReplicaState, RoutedRequest, RoutingPolicy
from microvllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class Decision:
    """Where one request went and why; ``hit_tokens``: its prompt tokens found in that replica's cache."""

    request_id: str
    replica: int
    reason: str
    matched_blocks: int
    prompt_tokens: int
    hit_tokens: int = 0


@dataclass
class ReplicaReport:
    requests: int = 0
    prompt_tokens: int = 0     # the prefix cache's queries, in tokens
    hit_tokens: int = 0        # ... and its hits

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class RouteReport:
    policy: str
    decisions: list[Decision] = field(default_factory=list)   # in arrival order
    outputs: list = field(default_factory=list)               # RequestOutput, in prompt order
    replicas: list[ReplicaReport] = field(default_factory=list)

    @property
    def hit_tokens(self) -> int:
        return sum(r.hit_tokens for r in self.replicas)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.replicas)

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit tokens / prompt tokens, over every replica."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def table(self, max_decisions: int = 8) -> str:
        lines = [f"policy {self.policy}: prefix-cache hits {self.hit_tokens} / {self.prompt_tokens} prompt tokens "
                 f"= {self.hit_rate:.0%}",
                 "  replica  requests  hit tokens / prompt tokens"]
        for index, r in enumerate(self.replicas):
            lines.append(f"  {index:>7}  {r.requests:>8}  {r.hit_tokens:>5} / {r.prompt_tokens:<5} ({r.hit_rate:.0%})")
        for d in self.decisions[:max_decisions]:
            lines.append(f"  {d.request_id} -> replica {d.replica} ({d.hit_tokens} hit tokens): {d.reason}")
        if len(self.decisions) > max_decisions:
            lines.append(f"  ... {len(self.decisions) - max_decisions} more decisions")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _engine_of(replica):
    return getattr(replica, "engine", replica)   # an LLM holds its Engine; an Engine is one


class Router:
    """``policy``: a ``RoutingPolicy`` or its name (``round_robin``, ``least_loaded``,
    ``prefix_aware``, ``kv_events``). ``arrivals_per_step``: requests routed between two
    steps of the replicas (how fast they arrive). ``kv_event_feed``: what feeds a
    ``kv_events`` policy (default: a ``BlockPoolPoller`` over the replicas)."""

    def __init__(self, replicas: Sequence, policy: RoutingPolicy | str = "prefix_aware", *,
                 arrivals_per_step: int = 2, kv_event_feed=None) -> None:
        if not replicas:
            raise ValueError("a Router needs at least one replica: pass a list of LLM or Engine objects")
        if arrivals_per_step < 1:
            raise ValueError(f"arrivals_per_step={arrivals_per_step}: route at least 1 request per step")
        self.engines = [_engine_of(r) for r in replicas]
        sizes = {e.config.cache_config.block_size for e in self.engines}
        if len(sizes) != 1:
            raise ValueError(f"the replicas have block sizes {sorted(sizes)}: give them all the same block_size "
                             "(a block hash is only comparable at one size)")
        self.block_size = sizes.pop()
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.policy.reset([e.num_kv_blocks - 1 for e in self.engines])   # block 0 is the null block
        self.arrivals_per_step = arrivals_per_step
        self.kv_event_feed = kv_event_feed
        if self.kv_event_feed is None and isinstance(self.policy, KVEventsPolicy):
            self.kv_event_feed = BlockPoolPoller(self.engines)
        self._ids = itertools.count()

    def replica_states(self) -> list[ReplicaState]:
        """Each replica's load, from the gauges its ``/metrics`` would show."""
        states = []
        for index, engine in enumerate(self.engines):
            gauges = {m.name.partition(":")[2]: getattr(m, "value") for m in engine_metrics(engine)
                      if m.name.endswith(("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))}
            states.append(ReplicaState(index, int(gauges["num_requests_running"]),
                                       int(gauges["num_requests_waiting"]), float(gauges["kv_cache_usage_perc"])))
        return states

    def routed_request(self, request_id: str, token_ids: Sequence[int]) -> RoutedRequest:
        """The request as a policy sees it: its block hashes, as the engine will compute them."""
        return RoutedRequest.from_token_ids(request_id, token_ids, self.block_size)

    def route(self, prompts, sampling_params: SamplingParams | None = None) -> RouteReport:
        """Route and run ``prompts`` (strings or ``{"prompt_token_ids": [...]}``); see the module docstring."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        first = self.engines[0]
        processed = [first.process_request(f"route-{next(self._ids)}", prompt, params, name=f"prompts[{i}]")
                     for i, prompt in enumerate(prompts)]
        report = RouteReport(self.policy.name, replicas=[ReplicaReport() for _ in self.engines])
        finished: dict = {}
        where: dict[str, int] = {}
        pending = list(processed)
        self._poll()
        while pending or any(e.has_unfinished_requests() for e in self.engines):
            for request in pending[:self.arrivals_per_step]:
                routed = self.routed_request(request.request_id, request.token_ids)
                choice = self.policy.choose(routed, self.replica_states())
                self.engines[choice.replica].add_processed_request(request)
                self.policy.on_routed(routed, choice)
                where[request.request_id] = len(report.decisions)
                report.decisions.append(Decision(request.request_id, choice.replica, choice.reason,
                                                 choice.matched_blocks, len(request.token_ids)))
            del pending[:self.arrivals_per_step]
            for engine in self.engines:
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
            self._poll()
        for request in processed:
            out = finished[request.request_id]
            index = where[request.request_id]
            decision = report.decisions[index]
            report.decisions[index] = Decision(decision.request_id, decision.replica, decision.reason,
                                               decision.matched_blocks, decision.prompt_tokens,
                                               out.num_cached_tokens)
            replica = report.replicas[decision.replica]
            replica.requests += 1
            replica.prompt_tokens += decision.prompt_tokens
            replica.hit_tokens += out.num_cached_tokens
            report.outputs.append(out)
        return report

    def _poll(self) -> None:
        if self.kv_event_feed is not None and isinstance(self.policy, KVEventsPolicy):
            self.kv_event_feed.poll(self.policy)
