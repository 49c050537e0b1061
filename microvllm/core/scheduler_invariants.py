"""The scheduler's bookkeeping rules, checked on top of the KV cache invariants.

    self.requests  ==  waiting  +  running  +  waiting_for_remote_kvs   (disjoint, no duplicates)
    running:  status RUNNING, len <= max_num_seqs,
              0 <= num_computed_tokens <= num_tokens (+ num_output_placeholders: async
              scheduling's tokens in flight), blocks cover them
    waiting:  status WAITING or PREEMPTED, num_computed_tokens == 0, no blocks
              (a KV connector's pinned blocks are held for it, not by it)

With a KV connector, every block holder is known, so ref counts can be checked exactly:

    block tables in the manager   only running and loading requests
    waiting_for_remote_kvs        status WAITING_FOR_REMOTE_KVS, num_computed_tokens == 0,
                                  blocks cover the tokens being loaded
    kv_pinned                     only waiting requests; every pinned block is cached
    kv_sending (delayed free)     only finished requests (not in self.requests)
    ref_cnt of a block == its entries in all of these   (a block freed while still
                                  being sent would show ref_cnt < its holders)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from microvllm.core.kv_cache_invariants import InvariantError
from microvllm.core.kv_cache_utils import cdiv
from microvllm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from microvllm.core.scheduler import Scheduler


def check_scheduler_invariants(scheduler: Scheduler) -> None:
    """Raise InvariantError if the scheduler's queues or the KV cache disagree. O(requests + blocks)."""
    scheduler.kv_cache_manager.check_invariants(scheduler.kv_blocks_held_outside())
    running_ids = [r.request_id for r in scheduler.running]
    waiting_ids = [r.request_id for r in scheduler.waiting]
    loading_ids = list(scheduler.waiting_for_remote_kvs)
    if len(set(running_ids)) != len(running_ids) or len(set(waiting_ids)) != len(waiting_ids):
        raise InvariantError(f"a request is queued twice: running={running_ids} waiting={waiting_ids}")
    both = (set(running_ids) & set(waiting_ids)) | (set(loading_ids) & (set(running_ids) | set(waiting_ids)))
    if both:
        raise InvariantError(f"requests {sorted(both)} are in two of waiting, running and waiting_for_remote_kvs")
    if set(running_ids) | set(waiting_ids) | set(loading_ids) != set(scheduler.requests):
        raise InvariantError(
            "scheduler.requests must hold exactly the waiting, running and loading requests: "
            f"requests={sorted(scheduler.requests)} running={running_ids} waiting={waiting_ids} "
            f"waiting_for_remote_kvs={loading_ids}"
        )
    if len(scheduler.running) > scheduler.max_num_seqs:
        raise InvariantError(f"{len(scheduler.running)} requests run but max_num_seqs is {scheduler.max_num_seqs}")
    for request in scheduler.running:
        _check_running_request(scheduler, request)
    for request in scheduler.waiting:
        _check_waiting_request(scheduler, request)
    _check_kv_connector_holders(scheduler, set(running_ids), set(waiting_ids))


def _check_kv_connector_holders(scheduler: Scheduler, running_ids: set[str], waiting_ids: set[str]) -> None:
    """Blocks held for loads, pins and delayed frees belong to the right requests."""
    kv = scheduler.kv_cache_manager
    for rid, request in scheduler.waiting_for_remote_kvs.items():
        if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS or request.num_computed_tokens != 0:
            raise InvariantError(f"loading request {rid!r} has status {request.status.name} and "
                                 f"num_computed_tokens={request.num_computed_tokens}: it must be "
                                 "WAITING_FOR_REMOTE_KVS with nothing computed until its load is done")
        needed = cdiv(scheduler.num_loading_tokens.get(rid, 0), kv.block_size)
        if rid not in scheduler.num_loading_tokens or any(len(ids) < needed for ids in kv.get_block_ids(rid)):
            raise InvariantError(f"loading request {rid!r} does not hold blocks for the "
                                 f"{scheduler.num_loading_tokens.get(rid)} tokens it loads")
    holders = running_ids | set(scheduler.waiting_for_remote_kvs)
    for manager in kv.single_type_managers:
        leaked = sorted(rid for rid, blocks in manager.req_to_blocks.items() if blocks and rid not in holders)
        if leaked:
            raise InvariantError(f"requests {leaked} hold KV blocks but are neither running nor loading: "
                                 "a finished or preempted request must free them (or hand them to kv_sending)")
    for rid, pinned in scheduler.kv_pinned.items():
        if rid not in waiting_ids:
            raise InvariantError(f"blocks are pinned for request {rid!r}, which is not waiting: a pin must "
                                 "be let go when its request is admitted or finished")
        for block in (b for group in pinned.blocks for b in group):
            if block.block_hash is None and not block.is_null:
                raise InvariantError(f"pinned block {block.block_id} of request {rid!r} is not in the prefix "
                                     "cache: the load's blocks must be cached when the load finishes")
    for rid in scheduler.kv_sending:
        if rid in scheduler.requests:
            raise InvariantError(f"request {rid!r} is unfinished but its blocks are in kv_sending: only a "
                                 "finished request's free may be delayed")


def _check_running_request(scheduler: Scheduler, request: Request) -> None:
    rid = request.request_id
    if request.status != RequestStatus.RUNNING:
        raise InvariantError(f"request {rid!r} is in running but has status {request.status.name}")
    # Async scheduling: a plan may compute tokens that steps in flight have yet to sample.
    known = request.num_tokens + request.num_output_placeholders
    if request.num_output_placeholders < 0 or not 0 <= request.num_computed_tokens <= min(
            known, scheduler.max_model_len):
        raise InvariantError(
            f"request {rid!r} has num_computed_tokens {request.num_computed_tokens}, outside "
            f"0..min(num_tokens={request.num_tokens} + num_output_placeholders="
            f"{request.num_output_placeholders}, max_model_len={scheduler.max_model_len})"
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
