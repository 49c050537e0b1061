"""SchedulerStats: what one engine-core step tells the front end about the core's state
(vLLM: ``vllm/v1/metrics/stats.py``, made by ``Scheduler.make_stats``).

Metrics, ``LLM.get_metrics()``, ``/metrics`` and the data-parallel load balancer read
these, never the scheduler's fields: the scheduler may be in another process::

    gauges, as the step left them        num_running_reqs  num_waiting_reqs  kv_cache_usage
    counts of this step only             prefix_cache_queries  prefix_cache_hits
    (the front end adds them up)         expert_load {layer: [tokens per expert]}
                                         kv_blocks_loaded  kv_blocks_saved   (a KV connector)
    running totals                       spec_decoding (drafts checked and accepted)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from microvllm.core.spec_decode_stats import SpecDecodingStats


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0          # share of the pool's usable blocks in use, 0..1
    # Prefix caching, vLLM's counters: tokens looked up when requests were admitted (or
    # resumed after a preemption) in this step, and how many of them were found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Mixtures of experts: (token, expert) pairs each MoE layer routed in this step.
    expert_load: dict[str, list[int]] = field(default_factory=dict)
    # A KV connector's blocks moved in this step (loaded into the pool, saved from it).
    kv_blocks_loaded: int = 0
    kv_blocks_saved: int = 0
    # Speculative decoding: the scheduler's running totals (None without drafts).
    spec_decoding: SpecDecodingStats | None = None
