"""SchedulerOutput: the immutable plan of one engine step, scheduler -> runner.

The runner keeps its own copy of each running request (token ids, block
table) and only receives what changed:

    step 1   scheduled_new_reqs    NewRequestData("a", prompt, block_ids=([3, 8],), num_computed_tokens=0)
    step 2   scheduled_cached_reqs CachedRequestData("a", new_block_ids=([],), num_computed_tokens=7)
    step 9   scheduled_cached_reqs CachedRequestData("a", new_block_ids=([5],), num_computed_tokens=8)
    ...      finished_req_ids / preempted_req_ids {"a"}  -> the runner forgets "a"

A request resumed after preemption comes back as a NEW request (full block
ids, prompt + outputs so far, which it recomputes).

``num_computed_tokens`` is the value *before* this step: the runner computes
tokens ``num_computed_tokens .. num_computed_tokens + num_scheduled_tokens[id] - 1``.
Everything is frozen and built from tuples, so the runner cannot change the
scheduler's state through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any


def _frozen_mapping(values: Mapping | None = None) -> Mapping:
    return MappingProxyType(dict(values or {}))


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen (first scheduled, or resumed after preemption)."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # non-empty only when resumed after preemption
    sampling_params: Any
    block_ids: tuple[tuple[int, ...], ...]  # full block table, one tuple per cache group
    num_computed_tokens: int  # prefix-cache hits (tokens the runner must not recompute)
    lora_request: Any = None  # its LoRA adapter (a LoRARequest), None for the base model


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds: only what changed this step."""

    req_id: str
    new_block_ids: tuple[tuple[int, ...], ...]  # blocks appended this step, per cache group
    num_computed_tokens: int


@dataclass(frozen=True)
class SchedulerOutput:
    """What to compute in one step. ``num_scheduled_tokens`` covers every scheduled request."""

    scheduled_new_reqs: tuple[NewRequestData, ...] = ()
    scheduled_cached_reqs: tuple[CachedRequestData, ...] = ()
    num_scheduled_tokens: Mapping[str, int] = field(default_factory=_frozen_mapping)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: frozenset[str] = frozenset()
    finished_req_ids: frozenset[str] = frozenset()  # finished or aborted since the last step
    num_prefix_hit_tokens: Mapping[str, int] = field(default_factory=_frozen_mapping)  # admitted this step
    # Speculative decoding: the draft tokens each request computes after its last token
    # this step (they are counted in num_scheduled_tokens); requests without drafts are
    # absent. The runner checks them with the rejection sampler.
    scheduled_spec_decode_tokens: Mapping[str, tuple[int, ...]] = field(default_factory=_frozen_mapping)
    # Structured outputs (set by the engine after scheduling, not by the scheduler): the
    # requests that sample under a grammar this step, and row i of grammar_bitmask (an
    # int32 tensor [rows, vocab/32]) says which ids request i may sample.
    structured_output_request_ids: tuple[str, ...] = ()
    grammar_bitmask: Any = None
    # KV connectors: the scheduler side's orders for the worker side this step (loads,
    # saves), built by ``connector.build_connector_meta``; None without a connector.
    kv_connector_metadata: Any = None

    def __post_init__(self) -> None:
        # Accept plain dicts from callers but store read-only views.
        for name in ("num_scheduled_tokens", "num_prefix_hit_tokens", "scheduled_spec_decode_tokens"):
            value = getattr(self, name)
            if not isinstance(value, MappingProxyType):
                object.__setattr__(self, name, _frozen_mapping(value))

    def __reduce__(self):
        # Pickled with plain dicts (a read-only view cannot be pickled), frozen again on
        # arrival: the MultiprocExecutor sends each plan to its worker processes.
        values = [getattr(self, f.name) for f in fields(self)]
        return (type(self), tuple(dict(v) if isinstance(v, MappingProxyType) else v for v in values))
