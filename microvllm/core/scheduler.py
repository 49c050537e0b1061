"""Scheduler: one rule, no phases. Each step, let every request's
``num_computed_tokens`` catch up with its ``num_tokens``, within a token budget.

That single rule gives continuous batching (requests join and leave any step),
chunked prefill (a long prompt takes several steps) and mixed steps (prefill
chunks and decode tokens in one batch):

    step   budget 8   request a (prompt 10)     request b (prompt 3)
     1     a: 8       prefill chunk 0..7        waiting
     2     a: 2 b: 3  prefill 8..9 -> sample    prefill 0..2 -> sample      (mixed)
     3     a: 1 b: 1  decode                    decode
     ...

One request's life:

    add_request -> WAITING --schedule: admitted (FCFS, prefix hits)--> RUNNING
                     ^                                                  |  prefill chunk(s),
                     | front of the queue                               |  then one decode
                     |                                                  |  token per step
                  PREEMPTED <--allocate_slots returned None-------------+
                  (blocks freed,                                         |
                   num_computed_tokens = 0,             update_from_output: stop condition
                   keeps its output tokens;             or finish_requests (abort)
                   resumes as a NEW request,                             v
                   recomputing prompt + outputs)     FINISHED_* (blocks freed, id in
                                                     the next finished_req_ids)

The same request in numbers (prompt of 10 tokens, budget 4, max_tokens 3):

    step                   1        2        3          4           5
    tokens computed        0..3     4..7     8..9       10 (o0)     11 (o1)
    num_computed_tokens    0 -> 4   4 -> 8   8 -> 10    10 -> 11    11 -> 12
    sampled (update)       -        -        o0         o1          o2: max_tokens
    num_tokens             10       10       10 -> 11   11 -> 12    12 -> 13, FINISHED
                           (new)    (cached) (last chunk: logits for o0)

Preemption is by recompute: the most recently admitted running request
(``running[-1]``) gives up its blocks. In a step that preempted, no waiting
request is admitted (it would just take the blocks back).

With a KV connector (``distributed/kv_transfer/``; core sees only ``SchedulerConnector``), a
waiting request may first load blocks from elsewhere, and a finished one may keep its
blocks while they are saved or sent (``_start_kv_loads`` and below)::

    WAITING --connector has blocks past the local hit--> WAITING_FOR_REMOTE_KVS
       ^        (blocks allocated; out of the queue)        | worker: finished_recving
       +---- front of the queue, its blocks cached and held ("pinned") until admitted,
             where schedule() finds them as prefix hits

    finished --request_finished says delay_free--> blocks held ("kv_sending") until the
             worker reports finished_sending: only then are they freed
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from microvllm.core.config import SchedulerConfig
from microvllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, PoolTooSmallError
from microvllm.core.outputs import EngineCoreOutput, KVConnectorOutput
from microvllm.core.request import Request, RequestStatus
from microvllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from microvllm.core.scheduler_invariants import check_scheduler_invariants
from microvllm.core.scheduler_kv_connector import KVConnectorScheduling
from microvllm.core.spec_decode_stats import SpecDecodingStats
from microvllm.core.stop_conditions import check_stop

if TYPE_CHECKING:
    from microvllm.core.kv_connector_protocol import SchedulerConnector

logger = logging.getLogger(__name__)

class Scheduler(KVConnectorScheduling):
    """Decides, each step, which requests compute how many tokens."""

    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager, *,
                 kv_connector: SchedulerConnector | None = None) -> None:
        self.scheduler_config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Otherwise a long prompt (or a preempted request's prompt + outputs)
            # could never be scheduled whole.
            raise ValueError(
                f"enable_chunked_prefill=False needs max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f">= max_model_len ({self.max_model_len}): raise max_num_batched_tokens, lower "
                "max_model_len, or enable chunked prefill"
            )
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()  # FCFS; preempted ones go to the front
        self.running: list[Request] = []  # in admission order: running[-1] is preempted first
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        # The runner must drop its copy of these at the next step (see undo_failed_step).
        self.reset_req_ids: set[str] = set()
        # Speculative decoding: drafts and accepted drafts, per position (metrics).
        self.spec_decoding_stats = SpecDecodingStats()
        # KV connector (None: none): its scheduler side, and the blocks it keeps busy.
        self.connector = kv_connector
        self.waiting_for_remote_kvs: dict[str, Request] = {}  # loading; out of the waiting queue
        self.num_loading_tokens: dict[str, int] = {}     # of each: its tokens once loaded
        self.kv_pinned: dict[str, KVCacheBlocks] = {}    # loaded, waiting: held until admitted
        self.kv_sending: dict[str, KVCacheBlocks] = {}   # finished, being saved/sent: delayed free
        self.kv_pool_short = False   # this step let pins go to make room: start no load after it
        self.connector_failures: dict[str, str] = {}     # a connector call raised: the engine fails them

    # ----------------------------------------------------------- requests in

    def add_request(self, request: Request) -> None:
        """Queue a new request. O(1). Whether it can ever run was checked before it got
        here (``Engine.process_request``); one that still cannot make progress is caught
        by ``schedule()`` (``_raise_stalled``)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request
        if self.connector is not None and len(self.waiting) <= self._kv_load_window():
            self._maybe_start_kv_load(request)

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish (abort, by default) waiting or running requests; free their blocks.
        Unknown or already finished ids are ignored. O(requests) each."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status.name} is not a finished status")
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.waiting_for_remote_kvs[request_id]
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        """Free a finished request's blocks, unless its connector still saves / sends them
        (vLLM's delayed free: they are freed when the worker reports ``finished_sending``)."""
        kv, request_id = self.kv_cache_manager, request.request_id
        delay_free = False
        if self.connector is not None:
            try:
                delay_free, request.kv_transfer_params = self.connector.request_finished(
                    request, kv.get_block_ids(request_id))
            except Exception as error:  # noqa: BLE001 - the request finishes anyway; its blocks go
                logger.error("the KV connector failed as request %r finished; its blocks are freed",
                             request_id, exc_info=error)
                delay_free, request.kv_transfer_params = False, None
        if delay_free:
            self.kv_sending[request_id] = kv.detach_blocks(request_id)
        else:
            kv.free(request)
        pinned = self.kv_pinned.pop(request_id, None)
        if pinned is not None:
            kv.free_blocks(pinned)
        self.finished_req_ids.add(request_id)
        del self.requests[request_id]

    # ----------------------------------------------------------------- plan

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then waiting ones in FCFS order.

        O(scheduled requests * their blocks). Raises PoolTooSmallError instead of
        returning an empty plan forever when the head request can never fit.
        """
        ### BEGIN SOLUTION
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_blocks: dict[str, KVCacheBlocks] = {}
        preempted: list[Request] = []

        # 1. Running requests, oldest first: each catches up as far as the budget allows.
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new_tokens = self._cap_new_tokens(request, request.num_computed_tokens, token_budget)
            if num_new_tokens == 0:
                index += 1
                continue
            blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            while blocks is None:
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if blocks is None:
                break  # the request itself was the last one left to preempt
            new_blocks[request.request_id] = blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            index += 1
        scheduled_running = [r for r in self.running if r.request_id in num_scheduled_tokens]

        # 2. Waiting requests, FCFS, unless this step had to preempt.
        scheduled_new: list[Request] = []
        prefix_hits: dict[str, int] = {}
        while not preempted and self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_hit_tokens
            if not self.enable_chunked_prefill and num_new_tokens > token_budget:
                break  # whole prompt or nothing: wait for a step with more budget
            num_new_tokens = self._cap_new_tokens(request, num_hit_tokens, token_budget)
            blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hit_blocks)
            if blocks is None:
                break  # pool full: stop admitting (FCFS, no overtaking)
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            prefix_hits[request.request_id] = num_hit_tokens
            scheduled_new.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens

        if not num_scheduled_tokens and not preempted and self.running:
            self._raise_stalled(self.running[0])
        if not num_scheduled_tokens and not preempted and self.waiting:
            self._raise_no_progress(self.waiting[0])
        return self._make_output(scheduled_new, scheduled_running, new_blocks,
                                 num_scheduled_tokens, preempted, prefix_hits)
        ### END SOLUTION

    def _cap_new_tokens(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        """Tokens to compute: the rest of the request (its draft tokens too, with speculative
        decoding), within the budget and max_model_len. Drafts that do not fit are dropped
        (``_make_output``). With async scheduling the tokens a step in flight will sample
        count as known (``num_output_placeholders``; 0 otherwise): the next decode is
        planned before the token it computes is known (``core/async_scheduler.py``)."""
        num_new_tokens = min(request.num_tokens_with_spec + request.num_output_placeholders - num_computed_tokens,
                             token_budget)
        # Positions must stay below max_model_len.
        return max(min(num_new_tokens, self.max_model_len - num_computed_tokens), 0)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0   # a step in flight still delivers its token (update_from_output)
        request.num_preemptions += 1
        request.spec_token_ids = []   # a resumed request recomputes its tokens; drafts come later
        self.waiting.appendleft(request)

    def _raise_no_progress(self, request: Request) -> None:
        """Nothing runs and the head request cannot start: say why instead of spinning.

        With a KV connector the pool may be short only for now: blocks come back when this
        step's loads and sends finish, or when held loaded blocks are let go (their
        requests then compute those tokens instead)."""
        if self.waiting_for_remote_kvs or self.kv_sending or self._tokens_in_flight():
            return
        if self._release_kv_pins(keep=request.request_id):
            self.kv_pool_short = True
            return
        kv = self.kv_cache_manager
        num_hit_tokens = kv.get_computed_blocks(request)[1]
        num_new_tokens = self._cap_new_tokens(request, num_hit_tokens, self.max_num_batched_tokens)
        num_blocks = kv.num_blocks_needed_for_chunk(num_hit_tokens, num_new_tokens)
        if num_blocks > kv.num_usable_blocks:
            raise PoolTooSmallError(request.request_id, num_hit_tokens + num_new_tokens, num_blocks,
                                    kv.num_usable_blocks, kv.block_size)
        raise RuntimeError(
            f"scheduler made no progress: request {request.request_id!r} ({request.num_tokens} tokens) "
            f"cannot be scheduled although nothing is running; this is a bug in the scheduler"
        )

    def _raise_stalled(self, request: Request) -> None:
        """A running request with nothing left to compute: the step that computed its last
        token never delivered the sampled one (e.g. Ctrl-C after the model ran). Without
        a new token it would wait forever; say so instead of spinning."""
        if self._tokens_in_flight():
            return
        raise RuntimeError(
            f"scheduler made no progress: running request {request.request_id!r} has all its "
            f"{request.num_tokens} tokens computed but no new token to compute, because the step "
            "that computed them did not finish (interrupted after the model ran?): abort its request"
        )

    def _tokens_in_flight(self) -> bool:
        """Async scheduling: a step in flight will sample a token for a running request, so
        a plan with nothing in it is no stall: the next one has work again."""
        return any(r.num_output_placeholders for r in self.running)

    def _make_output(self, scheduled_new: list[Request], scheduled_running: list[Request],
                     new_blocks: dict[str, KVCacheBlocks], num_scheduled_tokens: dict[str, int],
                     preempted: list[Request], prefix_hits: dict[str, int]) -> SchedulerOutput:
        """Freeze the plan, then advance num_computed_tokens (the runner will compute them)."""
        kv = self.kv_cache_manager
        new_reqs = tuple(
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=tuple(r.prompt_token_ids),
                output_token_ids=tuple(r.output_token_ids),
                sampling_params=r.sampling_params,
                block_ids=tuple(tuple(ids) for ids in kv.get_block_ids(r.request_id)),
                num_computed_tokens=r.num_computed_tokens,
                lora_request=r.lora_request,
            )
            for r in scheduled_new
        )
        cached_reqs = tuple(
            CachedRequestData(
                req_id=r.request_id,
                new_block_ids=tuple(tuple(ids) for ids in new_blocks[r.request_id].get_block_ids()),
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in scheduled_running
        )
        # Speculative decoding: the drafts that fit this step (scheduled past the last token).
        spec_tokens = {}
        for request in scheduled_running:
            num_spec = (request.num_computed_tokens + num_scheduled_tokens[request.request_id]
                        - request.num_tokens - request.num_output_placeholders)
            if num_spec > 0:
                spec_tokens[request.request_id] = tuple(request.spec_token_ids[:num_spec])
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            preempted_req_ids=frozenset(r.request_id for r in preempted) | self.reset_req_ids,
            finished_req_ids=frozenset(self.finished_req_ids),
            num_prefix_hit_tokens=prefix_hits,
            scheduled_spec_decode_tokens=spec_tokens,
        )
        for request in (*scheduled_running, *scheduled_new):
            request.num_computed_tokens += num_scheduled_tokens[request.request_id]
            known = request.num_tokens + request.num_output_placeholders
            request.is_prefill_chunk = request.num_computed_tokens < known
        self.finished_req_ids = set()
        self.reset_req_ids = set()
        if self.connector is not None:
            output = self._add_kv_connector_metadata(output, scheduled_new)
        return output

    def undo_failed_step(self, scheduler_output: SchedulerOutput) -> None:
        """The runner raised (or Ctrl-C stopped it) while computing this plan: put things
        back so that the next step is safe, as if the plan's work had never been done.

        None, some or all of the plan's KV may have been written, and the runner may or
        may not have taken the plan into its own copy of the requests. So:

        - every request of the plan is preempted (blocks freed, num_computed_tokens = 0,
          its tokens kept): it is recomputed when scheduled again, nothing is lost;
        - the blocks it was filling this step leave the prefix cache: ``allocate_slots``
          registered them when the plan was made, trusting the runner to fill them::

              request a  [ b3 | b8 | b1 ]   computing tokens 6..9 (B = 4)
                                ^^^^^^^   from block 6 // 4 = 1 on: maybe unwritten

        - the runner is told again, at the next step, to forget the plan's finished and
          preempted requests, and now also its scheduled ones.
        O(blocks of the plan's requests).
        """
        kv = self.kv_cache_manager
        starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        starts.update((r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_cached_reqs)
        scheduled = [r for r in self.running if r.request_id in starts]
        maybe_unwritten = [block for r in scheduled
                           for group in kv.get_blocks(r.request_id).blocks
                           for block in group[starts[r.request_id] // kv.block_size:]]
        self.running = [r for r in self.running if r.request_id not in starts]
        for request in reversed(scheduled):  # newest first: the waiting queue keeps FCFS order
            self._preempt(request)
        kv.forget_cached_blocks(maybe_unwritten)
        self.finished_req_ids |= scheduler_output.finished_req_ids
        self.reset_req_ids |= scheduler_output.preempted_req_ids | starts.keys()
        self._undo_kv_transfers()

    # ---------------------------------------------------------- results in

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]],
                           spec_token_ids: dict[str, list[int]] | None = None,
                           kv_connector_output: KVConnectorOutput | None = None) -> list[EngineCoreOutput]:
        """Append the runner's sampled tokens and stop finished requests.

        A request whose prefill is still partial (num_computed_tokens <
        num_tokens) sampled nothing real: anything given for it is ignored.
        Every other scheduled request must have at least one sampled token.
        Finished requests' blocks are freed here. O(scheduled requests).

        Speculative decoding: a request that computed d drafts gets 1..d + 1 tokens (the
        accepted drafts, then one more). The rejected drafts' KV is wrong, so
        ``num_computed_tokens`` steps back over them; their slots stay the request's and
        are written again by the next step::

            computed this step   o2 d0 d1 d2     (num_computed_tokens 9 -> 13)
            sampled              d0 d1 x         (d2 rejected: x is the target's token)
            num_computed_tokens  13 - 1 = 12     o2 d0 d1 computed; x is next step's input

        ``spec_token_ids``: the drafter's new guesses, checked at the next step.
        ``kv_connector_output``: the KV connector's finished loads and sends (its worker side).
        """
        outputs: list[EngineCoreOutput] = []
        stopped: dict[str, None] = {}  # in batch order (a set's order would vary with PYTHONHASHSEED)
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None:
                continue  # aborted since schedule()
            preempted = request.status == RequestStatus.PREEMPTED
            if request.status != RequestStatus.RUNNING and not (preempted and sampled_token_ids.get(request_id)):
                continue  # preempted since schedule(); async scheduling: a token it sampled still counts
            request.spec_token_ids = []
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id, ())
            if drafts:
                num_rejected = len(drafts) + 1 - len(sampled_token_ids.get(request_id, ()))
                if not 0 <= num_rejected <= len(drafts):
                    raise ValueError(f"request {request_id!r} checked {len(drafts)} drafts, so it must get 1 to "
                                     f"{len(drafts) + 1} tokens, got {sampled_token_ids.get(request_id)}")
                request.num_computed_tokens -= num_rejected
                self.spec_decoding_stats.observe(len(drafts), len(drafts) - num_rejected)
            token_ids = sampled_token_ids.get(request_id)
            if not self._sampled_this_step(request, token_ids):
                continue  # a prefill chunk: no token to sample yet
            if not token_ids:
                raise ValueError(
                    f"no sampled token for request {request_id!r}: it finished its prefill or decoded "
                    "this step, so the runner must return the token it sampled"
                )
            # Async scheduling: these tokens were placeholders until now (0 without it).
            request.num_output_placeholders = max(request.num_output_placeholders - len(token_ids), 0)
            appended = []
            for token_id in token_ids:
                request.append_output_token_ids(token_id)
                appended.append(token_id)
                if check_stop(request, self.max_model_len):
                    stopped[request_id] = None
                    if preempted:   # it waits for its turn: out of the queue
                        self.waiting.remove(request)
                    break
            outputs.append(EngineCoreOutput(request_id, tuple(appended), request.get_finished_reason(),
                                            request.stop_reason, max(request.num_cached_tokens, 0)))
        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]
            finished = {request_id: self.requests[request_id] for request_id in stopped}
            for request in finished.values():
                self._free_request(request)
            if self.connector is not None:   # what request_finished gave back goes to the client
                outputs = self._with_kv_transfer_params(outputs, finished)
        for request_id, new_drafts in (spec_token_ids or {}).items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.spec_token_ids = list(new_drafts)
        if self.connector is not None:
            self._update_from_kv_xfer_finished(kv_connector_output)
            self._start_or_hold_kv_loads(preempted=bool(scheduler_output.preempted_req_ids))
        return outputs

    def _sampled_this_step(self, request: Request, token_ids: list[int] | None) -> bool:
        """Did the step compute the request's last known token, so that it sampled the next?
        Right after a step, its state says so; ``AsyncScheduler`` asks the runner instead
        (a later plan has moved the request on since)."""
        return request.num_computed_tokens >= request.num_tokens

    # -------------------------------------------------------------- queries

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or blocks still being sent (a step must run to finish the send)."""
        return bool(self.requests) or bool(self.kv_sending)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def num_waiting_requests(self) -> int:
        """Waiting, as vLLM counts them: in the queue, or loading their KV from a peer (a
        decode side busy loading is not idle: a router must see it)."""
        return len(self.waiting) + len(self.waiting_for_remote_kvs)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block hash; False (nothing changed) while blocks are in use.

        ``reset_running_requests=True`` first preempts every running request (as vLLM
        does): their blocks are freed, and they are recomputed when scheduled again."""
        if reset_running_requests:
            while self.running:  # newest first, so the oldest ends up at the queue's front
                self._preempt(self.running.pop())
        self._release_kv_pins()
        return self.kv_cache_manager.reset_prefix_cache()

    def check_invariants(self) -> None:
        """KV cache invariants plus the scheduler's own bookkeeping. O(requests + blocks).
        Raises InvariantError; see ``core/scheduler_invariants.py``."""
        check_scheduler_invariants(self)
