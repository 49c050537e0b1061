"""The scheduler's half of the KV connector seam (vLLM: the connector calls inside
``vllm/v1/core/sched/scheduler.py``), kept beside ``Scheduler.schedule()``, which is a
course exercise and knows nothing of connectors.

A request's blocks, as the connector moves them (B = 4, a prompt of 14 tokens)::

    block hashes        h0   h1   h2   h3 | last 2 tokens
    local prefix hit    h0                 get_computed_blocks: 4 tokens
    connector has            h1   h2       get_num_new_matched_tokens: 8 more
    allocate_slots      [b7] [b2] [b9]     b7 touched (a hit); b2, b9 new, NOT cached yet
                                           (delay_cache_blocks: their KV is not there yet)
    status              WAITING_FOR_REMOTE_KVS, out of the waiting queue
    next step's plan    kv_connector_metadata: load h1 -> b2, h2 -> b9
    worker              start_load_kv copies them in before the forward; finished_recving
    update_from_output  cache b2, b9 (now real prefix-cache entries); the request goes back
                        to the front of the queue, its blocks held ("pinned") for it
    a later schedule()  get_computed_blocks finds b7 b2 b9: 12 hit tokens; the pin is let go

Delayed free: a request that finishes while the connector saves or sends its blocks
(``request_finished`` answers delay_free=True) gives its block table to ``kv_sending``;
the blocks are freed only when the worker lists the request in ``finished_sending``, once
(a second report frees nothing: the double free of a naive delayed free).

Who holds a block (the invariant checks count every holder):
running and loading requests (their block tables in the KV cache manager), ``kv_pinned``
(loaded, waiting to be admitted) and ``kv_sending`` (finished, being sent).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import deque
from collections.abc import Container, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from microvllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from microvllm.core.outputs import EngineCoreOutput, KVConnectorOutput
from microvllm.core.request import Request, RequestStatus
from microvllm.core.sched_output import SchedulerOutput

if TYPE_CHECKING:
    from microvllm.core.kv_connector_protocol import SchedulerConnector

T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KVLoadPlan:
    """What a connector offers one waiting request (``plan_kv_load``): the tokens past the
    local hit to load (whole blocks), the request's blocks they fill (indices into its block
    hashes), and ``load_async``: True when the request must wait in WAITING_FOR_REMOTE_KVS
    until the worker reports the load finished, False when there is nothing to wait for."""

    num_external_tokens: int
    block_indices: tuple[int, ...]
    load_async: bool


def plan_kv_load(block_hashes: Sequence, num_tokens: int, num_local_tokens: int, block_size: int,
                 remote_has: Container) -> KVLoadPlan:
    """The scheduler side's decision for one waiting request (exercise 19; the
    ``OffloadingConnector``'s ``get_num_new_matched_tokens`` asks it): the blocks past the
    local prefix hit (``num_local_tokens``, whole blocks) whose hashes ``remote_has``
    holds, in a row from the first block past the hit, stopping at the first it lacks and
    before the block holding the request's last token (that token is computed: its logits
    give the next token). Nothing to load: ``KVLoadPlan(0, (), False)``, the request may be
    scheduled now; else it waits for the load (``load_async=True``). O(blocks)."""
    ### BEGIN SOLUTION
    first = num_local_tokens // block_size        # blocks [0, first) are local hits already
    last = (num_tokens - 1) // block_size         # the last token's block is computed, never loaded
    indices = []
    for index in range(first, min(last, len(block_hashes))):
        if block_hashes[index] not in remote_has:
            break                                 # each hash covers its parents: a miss ends the run
        indices.append(index)
    return KVLoadPlan(len(indices) * block_size, tuple(indices), bool(indices))
    ### END SOLUTION


def release_finished_sends(kv_sending: dict[str, T], finished_sending: Iterable[str] | None) -> list[T]:
    """The delayed free (exercise 19): the block lists to free now that the worker reports
    ``finished_sending``, in request-id order, each taken out of ``kv_sending`` so that it is
    freed once. A request reported again, or never delayed, frees nothing (adds nothing to
    the list); a request still being sent (not reported) keeps its blocks. O(reported)."""
    ### BEGIN SOLUTION
    freed = []
    for request_id in sorted(finished_sending or ()):
        blocks = kv_sending.pop(request_id, None)
        if blocks is not None:   # reported again (or never delayed): nothing to free
            freed.append(blocks)
    return freed
    ### END SOLUTION


class KVConnectorContractError(ValueError):
    """A connector broke the seam's contract (an offer of partial blocks, or a load the
    request would not wait for): a bug in the connector, raised to the caller, never
    isolated as one request's fault."""


class KVConnectorScheduling:
    """Mixed into ``Scheduler``: every call to the connector's scheduler side. Each method
    is a no-op path unless ``self.connector`` is set (the scheduler checks first)."""

    # Set by Scheduler.__init__.
    connector: SchedulerConnector | None
    kv_cache_manager: KVCacheManager
    max_num_seqs: int
    waiting: deque[Request]
    running: list[Request]
    waiting_for_remote_kvs: dict[str, Request]
    num_loading_tokens: dict[str, int]
    kv_pinned: dict[str, KVCacheBlocks]
    kv_sending: dict[str, KVCacheBlocks]
    kv_pool_short: bool
    connector_failures: dict[str, str]
    requests: dict[str, Request]

    def _kv_load_window(self) -> int:
        """How many waiting requests (from the front) could be admitted next step: only
        they may start a load, so that loads never hold blocks far ahead of their use."""
        return self.max_num_seqs - len(self.running) - len(self.waiting_for_remote_kvs)

    def _start_kv_loads(self) -> None:
        """Ask the connector about the waiting requests that could be admitted next
        (called after each step and when a request arrives). O(window * blocks)."""
        for request in list(itertools.islice(self.waiting, max(self._kv_load_window(), 0))):
            if request.request_id not in self.kv_pinned and request.request_id not in self.connector_failures:
                self._maybe_start_kv_load(request)

    def _maybe_start_kv_load(self, request: Request) -> bool:
        """``_start_kv_load`` under fault isolation: a connector that raises for one request
        (its ``kv_transfer_params`` are a client's) fails that request, never the engine.
        Its blocks go back; the engine reports it (``take_connector_failures``)."""
        try:
            return self._start_kv_load(request)
        except KVConnectorContractError:
            raise   # the connector's own bug, the same for every request: say so loudly
        except Exception as error:  # noqa: BLE001 - any connector error is that request's
            logger.error("the KV connector failed for request %r; the request fails, the engine goes on",
                         request.request_id, exc_info=error)
            if request.status == RequestStatus.WAITING:
                self.kv_cache_manager.free(request)
            self.connector_failures[request.request_id] = f"the KV connector failed: {type(error).__name__}: {error}"
            return False

    def take_connector_failures(self) -> dict[str, str]:
        """Requests whose connector call raised, with why (the engine fails each); each once."""
        failures, self.connector_failures = self.connector_failures, {}
        return {rid: why for rid, why in failures.items() if rid in self.requests}

    def _start_kv_load(self, request: Request) -> bool:
        """vLLM's order: the local prefix hit, then ``get_num_new_matched_tokens`` for the
        tokens past it, ``allocate_slots`` for them (not cached until loaded), then
        ``update_state_after_alloc``. True if a load started."""
        assert self.connector is not None
        kv = self.kv_cache_manager
        if not kv.enable_caching:
            return False   # loaded blocks reach the request as prefix-cache hits
        hit_blocks, num_local = kv.get_computed_blocks(request)
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        if num_external <= 0:
            return False
        if not load_async:
            raise KVConnectorContractError(
                f"the KV connector offered {num_external} tokens for request {request.request_id!r} with "
                "load_async=False: microvllm loads between steps only, so a request with blocks to load must "
                "wait for them (load_async=True); scheduling it now would compute on blocks not loaded yet")
        if num_local + num_external >= request.num_tokens or num_external % kv.block_size:
            raise KVConnectorContractError(
                f"the KV connector offered {num_external} tokens past {num_local} for request "
                f"{request.request_id!r} ({request.num_tokens} tokens): it must offer whole blocks and "
                "leave the last token to be computed")
        if kv.allocate_slots(request, num_external, num_local, hit_blocks, delay_cache_blocks=True) is None:
            return False   # no room now: the request computes those tokens instead
        self.connector.update_state_after_alloc(request, kv.get_blocks(request.request_id), num_external)
        self.waiting.remove(request)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kvs[request.request_id] = request
        self.num_loading_tokens[request.request_id] = num_local + num_external
        return True

    def _update_from_kv_xfer_finished(self, output: KVConnectorOutput | None) -> None:
        """The worker's report: free the blocks of finished sends (once), and send each
        loaded request back to the front of the queue with its blocks cached and pinned."""
        assert self.connector is not None
        if output is None:
            return
        self.connector.update_connector_output(output)
        kv = self.kv_cache_manager
        for blocks in release_finished_sends(self.kv_sending, output.finished_sending):
            kv.free_blocks(blocks)
        for request_id in sorted(output.failed_recving or ()):   # the load failed: compute instead
            request = self.waiting_for_remote_kvs.pop(request_id, None)
            if request is None:
                continue
            self.num_loading_tokens.pop(request_id)
            kv.free(request)   # never cached (delay_cache_blocks): nobody else can hold them
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        recved = output.finished_recving or set()
        loaded = [r for r in self.waiting_for_remote_kvs.values() if r.request_id in recved]
        for request in reversed(loaded):   # the first loaded ends up at the front
            request_id = request.request_id
            del self.waiting_for_remote_kvs[request_id]
            num_loaded = self.num_loading_tokens.pop(request_id)
            kv.cache_blocks(request, num_loaded)
            blocks = kv.detach_blocks(request_id)
            num_full = num_loaded // kv.block_size   # any block past them (lookahead) goes now
            kv.free_blocks(KVCacheBlocks(tuple(group[num_full:] for group in blocks.blocks)))
            self.kv_pinned[request_id] = KVCacheBlocks(tuple(group[:num_full] for group in blocks.blocks))
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def _with_kv_transfer_params(self, outputs: list[EngineCoreOutput],
                                 finished: dict[str, Request]) -> list[EngineCoreOutput]:
        """The finished requests' outputs carry what ``request_finished`` gave back
        (a prefill instance's ``kv_transfer_params``: where the decode side reads the KV)."""
        return [dataclasses.replace(out, kv_transfer_params=finished[out.request_id].kv_transfer_params)
                if out.request_id in finished and finished[out.request_id].kv_transfer_params is not None
                else out for out in outputs]

    def _add_kv_connector_metadata(self, output: SchedulerOutput, scheduled_new: list[Request]) -> SchedulerOutput:
        """End of ``schedule()``: admitted requests hold their loaded blocks as prefix hits
        now, so their pins go; the connector's orders for this step join the plan."""
        assert self.connector is not None
        for request in scheduled_new:
            pinned = self.kv_pinned.pop(request.request_id, None)
            if pinned is not None:
                self.kv_cache_manager.free_blocks(pinned)
        return dataclasses.replace(output, kv_connector_metadata=self.connector.build_connector_meta(output))

    def _release_kv_pins(self, keep: str | None = None) -> bool:
        """Let go of pinned loaded blocks, newest first; True if any went. Their requests
        compute those tokens instead. ``keep``: the head of the queue, the request that
        should fit next, keeps its own unless nobody else holds any."""
        request_ids = [rid for rid in self.kv_pinned if rid != keep] or list(self.kv_pinned)
        for request_id in reversed(request_ids):
            self.kv_cache_manager.free_blocks(self.kv_pinned.pop(request_id))
        return bool(request_ids)

    def _start_or_hold_kv_loads(self, preempted: bool) -> None:
        """After a step. One that had to preempt, or to let pins go before the head of the
        queue could fit (``kv_pool_short``), found the pool short: no new load may take the
        blocks that were made free, or the same requests would load, block and let go
        forever (vLLM considers no waiting request in a step that preempted). A step that
        preempted also lets every pin go: otherwise a running request could preempt itself
        step after step while waiting requests sit on the pool."""
        if preempted:
            self._release_kv_pins()
        elif not self.kv_pool_short:
            self._start_kv_loads()
        self.kv_pool_short = False

    def _undo_kv_transfers(self) -> None:
        """A step failed: its loads and sends may be half done. Loading requests go back to
        the queue without their (never cached) blocks, and sends are given up: their blocks
        are freed. The connector forgets what it handed over and was not reported."""
        kv = self.kv_cache_manager
        given_up = set(self.kv_sending)
        for request_id in list(self.kv_sending):
            kv.free_blocks(self.kv_sending.pop(request_id))
        if given_up and self.connector is not None:   # their blocks are free: never serve them again
            self.connector.update_connector_output(KVConnectorOutput(finished_sending=given_up))
        for request in reversed(list(self.waiting_for_remote_kvs.values())):
            kv.free(request)
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        self.waiting_for_remote_kvs.clear()
        self.num_loading_tokens.clear()

    def kv_blocks_held_outside(self) -> list[list]:
        """Block lists held by the scheduler itself (pins and delayed frees), one per group
        and holder, for the KV cache invariant checks."""
        return [group for blocks in (*self.kv_pinned.values(), *self.kv_sending.values())
                for group in blocks.blocks]
