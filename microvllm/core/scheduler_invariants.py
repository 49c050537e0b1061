"""The scheduler's bookkeeping rules, checked on top of the KV cache invariants.

    self.requests  ==  waiting  +  running          (disjoint, no duplicates)
    running:  status RUNNING, len <= max_num_seqs,
              0 <= num_computed_tokens <= num_tokens, blocks cover them
    waiting:  status WAITING or PREEMPTED, num_computed_tokens == 0, no blocks
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from microvllm.core.kv_cache_invariants import InvariantError
from microvllm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from microvllm.core.scheduler import Scheduler


def check_scheduler_invariants(scheduler: Scheduler) -> None:
    """Raise InvariantError if the scheduler's queues or the KV cache disagree. O(requests + blocks)."""
    scheduler.kv_cache_manager.check_invariants()
    running_ids = [r.request_id for r in scheduler.running]
    waiting_ids = [r.request_id for r in scheduler.waiting]
    if len(set(running_ids)) != len(running_ids) or len(set(waiting_ids)) != len(waiting_ids):
        raise InvariantError(f"a request is queued twice: running={running_ids} waiting={waiting_ids}")
    both = set(running_ids) & set(waiting_ids)
    if both:
        raise InvariantError(f"requests {sorted(both)} are both waiting and running")
    if set(running_ids) | set(waiting_ids) != set(scheduler.requests):
        raise InvariantError(
            "scheduler.requests must hold exactly the waiting and running requests: "
            f"requests={sorted(scheduler.requests)} running={running_ids} waiting={waiting_ids}"
        )
    if len(scheduler.running) > scheduler.max_num_seqs:
        raise InvariantError(f"{len(scheduler.running)} requests run but max_num_seqs is {scheduler.max_num_seqs}")
    for request in scheduler.running:
        _check_running_request(scheduler, request)
    for request in scheduler.waiting:
        _check_waiting_request(scheduler, request)


def _check_running_request(scheduler: Scheduler, request: Request) -> None:
    rid = request.request_id
    if request.status != RequestStatus.RUNNING:
        raise InvariantError(f"request {rid!r} is in running but has status {request.status.name}")
    if not 0 <= request.num_computed_tokens <= min(request.num_tokens, scheduler.max_model_len):
        raise InvariantError(
            f"request {rid!r} has num_computed_tokens {request.num_computed_tokens}, outside "
            f"0..min(num_tokens={request.num_tokens}, max_model_len={scheduler.max_model_len})"
        )
    manager = scheduler.kv_cache_manager
    for group_id, block_ids in enumerate(manager.get_block_ids(rid)):
        needed = manager.kv_cache_groups[group_id].num_table_entries(request.num_computed_tokens)
        if len(block_ids) < needed:
            raise InvariantError(
                f"request {rid!r}, group {group_id}: {len(block_ids)} blocks cannot hold its "
                f"{request.num_computed_tokens} computed tokens"
            )


def _check_waiting_request(scheduler: Scheduler, request: Request) -> None:
    rid = request.request_id
    if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
        raise InvariantError(f"waiting request {rid!r} has status {request.status.name}")
    if request.num_computed_tokens != 0 or any(scheduler.kv_cache_manager.get_block_ids(rid)):
        raise InvariantError(
            f"waiting request {rid!r} still has num_computed_tokens={request.num_computed_tokens} "
            "or KV blocks: preemption must free its blocks and reset num_computed_tokens to 0"
        )
