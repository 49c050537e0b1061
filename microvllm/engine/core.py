"""EngineCore: the loop's inner part — the scheduler, the model, and nothing of text
(vLLM: ``vllm/v1/engine/core.py``).

    __init__(config, components=, trace=, debug_invariants=, fault_isolation=):
              platform ──> Executor (loads the model: here, or in tensor_parallel_size
              worker processes) ──> _initialize_kv_caches (how many blocks fit) ──>
              KV cache manager, KV connector (scheduler side), Scheduler,
              structured-output manager, KV event publisher

    add_request(EngineCoreRequest)       one sample: token ids in, no text, no n > 1
    abort_requests([ids])                the client went away, or a stop string was found
    step() -> EngineCoreOutputs:
        plan   = schedule()                      who computes how many tokens (+ grammar masks)
        output = executor.execute_model(plan)    one forward pass, then sampling
        return update_from_output(plan, output)  append, stop checks, free; grammars advance;
                                                 per request: new token ids, logprobs, finish
                                                 reason; plus SchedulerStats

    step_with_batch_queue()   async scheduling: the same three, with two plans in flight
                              (the forward runs on the core's execute thread)::

        core thread      schedule N | schedule N+1 | wait N, update N | schedule N+2 | wait N+1 ...
        execute thread              | forward N ............ | forward N+1 ............ |

    step_fn   the one a client calls: step, or step_with_batch_queue with async scheduling

Everything a person reads — text, stop strings, ``n`` samples of one prompt, the
``RequestOutput`` — is the front end's (``engine/engine.py``: ``LLMEngine`` with its
``InputProcessor`` and ``OutputProcessor``), which talks to the core through a client
(``engine/core_client.py``). The core knows requests by the scheduler's ids only: a
sample of an ``n > 1`` request is a request of its own here.

The course's hooks attach here and only here: the learner's classes (``components``),
the step trace (``trace=True``) and the bookkeeping checks (``debug_invariants``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from microvllm import envs
from microvllm.config import EngineConfig
from microvllm.config.components import check_components, component
from microvllm.core.async_scheduler import with_async_scheduling
from microvllm.core.block_pool import BlockPool
from microvllm.core.kv_cache_manager import KVCacheManager, PoolTooSmallError
from microvllm.core.lora_scheduling import with_max_loras
from microvllm.core.outputs import EngineCoreOutput
from microvllm.core.request import Request, RequestStatus
from microvllm.core.sched_output import SchedulerOutput
from microvllm.core.scheduler import Scheduler
from microvllm.core.stats import SchedulerStats
from microvllm.distributed.kv_transfer.kv_connector.base import KVConnectorRole
from microvllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from microvllm.engine.fault_isolation import FaultIsolation
from microvllm.engine.prompts import PromptProcessor
from microvllm.engine.step_tracer import StepTracer
from microvllm.executor import get_executor_class
from microvllm.executor.multiproc_executor import WorkerError
from microvllm.lora.request import LoRARequest
from microvllm.platforms import platform_for
from microvllm.sampling_params import SamplingParams
from microvllm.structured_output import StructuredOutputGrammar, StructuredOutputManager
from microvllm.structured_output.backend_regex import TokenTrie
from microvllm.structured_output.bitmask import allows_nothing

logger = logging.getLogger(__name__)

# Errors after which the core's state is unknown (a worker process died): they stop
# the engine instead of failing one request (``engine/fault_isolation.py``).
FATAL_ERRORS: tuple[type[BaseException], ...] = (WorkerError,)


@dataclass
class EngineCoreRequest:
    """One request as the core takes it (vLLM: ``EngineCoreRequest``): token ids and
    sampling parameters, already checked by the front end; one sample (``n == 1``).

    ``grammar``: its structured-output matcher, compiled by the front end (a server
    compiles in worker processes, within a time limit). ``prompt``: the prompt's text,
    for the step trace's labels only (the course's widgets); vLLM's has no such field.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    cache_salt: str | None = None
    grammar: StructuredOutputGrammar | None = None
    prompt: str | None = None
    lora_request: LoRARequest | None = None   # its adapter (checked by the front end); None: the base model
    # The chat's template kwargs, for the reasoning gate (``enable_thinking``): vLLM's field
    reasoning_parser_kwargs: dict | None = None


@dataclass
class EngineCoreOutputs:
    """What one core step (or an abort) gives back (vLLM: ``EngineCoreOutputs``): one
    ``EngineCoreOutput`` per request that moved, and the core's stats after the step."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    engine_index: int = 0   # which data-parallel core (its process sets it)


class EngineCore:
    """The scheduler and the model, one step at a time. Built from a frozen
    ``EngineConfig``; ``prompts`` (the tokenizer and the EOS ids) is shared with a front
    end in the same process, or read from the model folder here."""

    def __init__(self, config: EngineConfig, *, components: dict[str, type] | None = None,
                 trace: bool = False, debug_invariants: bool = False, fault_isolation: bool = False,
                 prompts: PromptProcessor | None = None):
        check_components(components)
        if trace and config.scheduler_config.async_scheduling:
            raise ValueError("trace=True records one plan per step, and async scheduling keeps two in "
                             "flight: turn one of them off (async_scheduling=False to trace)")
        self.config = config
        self.components = components
        self.debug_invariants = debug_invariants
        model_config, cache_config = config.model_config, config.cache_config
        self.platform = platform_for(config.device_config)
        self.prompts = prompts if prompts is not None else PromptProcessor.from_model_folder(
            model_config.model_path, vocab_size=model_config.hf_config.vocab_size)
        # One worker here (tensor_parallel_size=1), or one process per rank.
        self.executor = get_executor_class(config.parallel_config)(
            config, self.prompts.eos_token_ids, self.platform, components)
        self.num_kv_blocks = self._initialize_kv_caches()
        block_size = cache_config.block_size
        specs = self.executor.kv_cache_layout.kv_cache_specs(    # one per cache group
            block_size, mamba_prefix_caching=cache_config.mamba_cache_mode != "none")
        # component(): the class given in components (an exercise's), else the engine's.
        kv_events = config.kv_events_config is not None and config.kv_events_config.enable_kv_cache_events
        self.kv_cache_manager = component(components, "kv_cache_manager", KVCacheManager)(
            specs, self.num_kv_blocks, block_size, enable_caching=cache_config.enable_prefix_caching,
            block_pool_class=component(components, "block_pool", BlockPool),
            num_lookahead_tokens=config.speculative_config.num_lookahead_tokens if config.speculative_config else 0,
            max_model_len=config.scheduler_config.max_model_len,
            **({"enable_kv_cache_events": True} if kv_events else {}))   # off: an exercise's pool needs no events
        # A KV connector's scheduler side (kv_transfer_config); its worker side is in each worker.
        kv_connector = None if config.kv_transfer_config is None else KVConnectorFactory.create_connector(
            config, KVConnectorRole.SCHEDULER, self.num_kv_blocks, specs)
        scheduler_class = component(components, "scheduler", Scheduler)
        if config.scheduler_config.async_scheduling:
            scheduler_class = with_async_scheduling(scheduler_class)
        lora_options = {}
        if config.lora_config is not None:   # at most max_loras adapters per step
            scheduler_class = with_max_loras(scheduler_class)
            lora_options = {"max_loras": config.lora_config.max_loras}
        self.scheduler = scheduler_class(
            config.scheduler_config, self.kv_cache_manager,
            **({"kv_connector": kv_connector} if kv_connector is not None else {}), **lora_options)
        # Async scheduling: the plans sent to the execute thread and not yet updated from,
        # oldest first (vLLM's batch_queue: two, so one is planned while one runs).
        self.batch_queue: deque[tuple[SchedulerOutput, object, Future]] | None = None
        if config.scheduler_config.async_scheduling:
            self.batch_queue, self.batch_queue_size = deque(), 2
            self._execute_thread = ThreadPoolExecutor(1, thread_name_prefix="microvllm-execute")
        self.structured_output_manager = StructuredOutputManager(
            self.prompts.tokenizer, model_config.hf_config.vocab_size,
            config.structured_outputs_config.structured_outputs_backend,
            token_trie=component(components, "token_trie", TokenTrie),   # the course backend's vocabulary trie
            limits=config.structured_outputs_config, cache_bytes=envs.xgrammar_cache_bytes(),
            reasoning_parser=config.structured_outputs_config.reasoning_parser)
        self.tracer = StepTracer(self.scheduler, model_config.hf_config.vocab_size) if trace else None
        self._last_step: tuple | None = None   # what the last step's trace record was made of
        # Serving sets this: a step's exception then fails only the request at fault.
        # Offline (None) it is raised, as vLLM's LLM does.
        self.fault_isolation = FaultIsolation() if fault_isolation else None
        self.num_steps = 0
        # A KV connector's running totals, at the last step (the stats carry the difference).
        self._kv_moved = (0, 0)
        self._prefix_cache_counts = (0, 0)   # (queries, hits) of the last schedule()
        # KV cache events for a router (distributed/kv_events.py): the block pool's events
        # of each step go out as one batch. Started last: nothing after it can fail.
        self.kv_event_publisher = None
        if kv_events:
            from microvllm.distributed.kv_events import EventPublisherFactory as Publishers
            self.kv_event_publisher = Publishers.create(config.kv_events_config,
                                                        config.parallel_config.data_parallel_rank)
            self._stop_kv_event_publisher = weakref.finalize(self, self.kv_event_publisher.shutdown)

    def _initialize_kv_caches(self) -> int:
        """How many KV blocks: ``num_kv_blocks`` if given, else as many as the executor
        says fit (the platform measures: on a CPU ``kv_cache_memory_bytes``; on a GPU
        ``gpu_memory_utilization`` of its free memory, less the profiling pass's peak),
        but no more than could ever be used. The executor then allocates them (vLLM:
        ``EngineCore._initialize_kv_caches``)."""
        cache, scheduler = self.config.cache_config, self.config.scheduler_config
        num_blocks = cache.num_kv_blocks
        if num_blocks is None:
            fits = self.executor.determine_num_kv_blocks()
            # No more than max_num_seqs requests of max_model_len tokens could ever use
            # (+1: the null block); a tiny model would otherwise get ~100k blocks.
            most_useful = scheduler.max_num_seqs * -(-scheduler.max_model_len // cache.block_size) + 1
            num_blocks = max(2, min(fits, most_useful))
            logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB, %s)", num_blocks,
                        cache.block_size, (num_blocks - 1) * cache.block_size,
                        num_blocks * self.executor.kv_cache_bytes_per_block() / 2**20,
                        self.config.model_config.torch_dtype)
        self.executor.initialize_kv_cache(num_blocks)
        return num_blocks

    # ------------------------------------------------------------ requests
    def check_fits(self, name: str, token_ids: list[int]) -> None:
        """``ValueError`` if this prompt could never run: too long for ``max_model_len`` (with
        room for one new token), or for the whole pool (in chunks of at most one step's
        budget). Changes nothing: the front end asks before it adds a request."""
        max_len = self.config.scheduler_config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"request {name!r}: the prompt has {len(token_ids)} tokens but "
                             f"max_model_len is {max_len} (room is needed for at least one new "
                             "token): shorten the prompt or raise max_model_len")
        manager = self.kv_cache_manager
        num_blocks = manager.num_blocks_to_start(len(token_ids),
                                                 self.config.scheduler_config.max_num_batched_tokens)
        if num_blocks > manager.num_usable_blocks:
            raise PoolTooSmallError(name, len(token_ids) + 1, num_blocks,
                                    manager.num_usable_blocks, self.config.cache_config.block_size)

    def max_prompt_tokens(self) -> int:
        """The longest prompt ``check_fits`` accepts: a front end in another process checks
        lengths against it, and asks the core only about a longer one (the error's words)."""
        low, high = 0, self.config.scheduler_config.max_model_len - 1   # low fits (no prompt)
        while low < high:   # the blocks a prompt needs grow with its length: bisect
            middle = (low + high + 1) // 2
            try:
                self.check_fits("", [0] * middle)
                low = middle
            except ValueError:
                high = middle - 1
        return low

    def check_kv_transfer_params(self, kv_transfer_params: dict | None, token_ids: list[int]) -> None:
        """A KV connector's say on a request's ``kv_transfer_params`` (e.g. a producer the
        operator did not allow): ``ValueError`` if it refuses them."""
        if kv_transfer_params is not None and self.scheduler.connector is not None:
            self.scheduler.connector.check_request(kv_transfer_params, token_ids)

    def request_refused(self, kv_transfer_params: dict | None, token_ids: list[int] | None) -> None:
        """A request with ``kv_transfer_params`` was refused before it was added: a KV
        connector tells the peer that holds its blocks to let them go."""
        if isinstance(kv_transfer_params, dict) and self.scheduler.connector is not None:
            self.scheduler.connector.request_refused(kv_transfer_params, token_ids)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue one checked request (vLLM: ``EngineCore.add_request``)."""
        if self.tracer is not None:
            self.tracer.add_prompt(request.request_id, request.prompt)
        grammar = request.grammar
        if grammar is None and request.sampling_params.structured_outputs is not None:
            # From another process (a matcher cannot cross a socket): compiled here, from
            # the grammar cache when the front end compiled the same spec.
            grammar = self.structured_output_manager.compile(request.sampling_params, 1)[0]
        if grammar is not None:
            self.structured_output_manager.add(request.request_id, grammar, request.prompt_token_ids,
                                               request.reasoning_parser_kwargs)
        self.scheduler.add_request(Request(
            request.request_id, request.prompt_token_ids, request.sampling_params,
            eos_token_id=request.eos_token_id, block_size=self.config.cache_config.block_size,
            arrival_time=request.arrival_time, cache_salt=request.cache_salt,
            lora_request=request.lora_request))

    def abort_requests(self, request_ids: Iterable[str], *, stop_string: bool = False) -> None:
        """Finish these requests and free their blocks; unknown or finished ids are
        ignored. ``stop_string``: the front end found a stop string in their text (the
        trace then shows them finished by the step that produced it)."""
        request_ids = [r for r in request_ids if r in self.scheduler.requests]
        if request_ids:
            self.scheduler.finish_requests(
                request_ids, RequestStatus.FINISHED_STOPPED if stop_string else RequestStatus.FINISHED_ABORTED)
        self._forget_finished_grammars()
        if stop_string and request_ids and self._last_step is not None:
            self._last_step[-1].extend(request_ids)
            self._record_step(redo=True)   # the step's record shows them finished, their blocks freed
        else:
            self._last_step = None   # anything else is between two steps: the next record shows it

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or (async scheduling) a step in flight to update from."""
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    # ---------------------------------------------------------------- step
    def step(self) -> EngineCoreOutputs:
        """One step: schedule, execute, update (vLLM: ``EngineCore.step``)."""
        self._last_step = None
        failed = self._fail_connector_casualties()   # never scheduled
        plan = self.schedule()
        traced = self.tracer.begin(plan) if self.tracer is not None else None
        try:
            model_output = self.executor.execute_model(plan)
        except BaseException as error:
            # Ctrl-C (KeyboardInterrupt) or an error inside the model: this step's KV
            # may be half written. The scheduler puts the step's requests back to be
            # recomputed, so the core stays consistent and usable.
            self.scheduler.undo_failed_step(plan)
            return EngineCoreOutputs(failed + self._isolate_or_raise(plan, error), self.make_stats(plan),
                                     time.monotonic())
        outputs = self.update_from_output(plan, model_output, traced)
        outputs.outputs[:0] = failed
        return outputs

    def step_fn(self) -> EngineCoreOutputs | None:
        """The step a client runs (vLLM picks ``step_fn`` once; a bound method kept on the
        core would tie it in a reference cycle, and a core must go when its last user does)."""
        return self.step() if self.batch_queue is None else self.step_with_batch_queue()

    def step_with_batch_queue(self) -> EngineCoreOutputs | None:
        """One step of async scheduling (vLLM: ``EngineCore.step_with_batch_queue``):

        1. if fewer than two plans are in flight, plan one and send it to the execute
           thread; if that left room for another, return None at once (nothing finished:
           a core in its own process then sends nothing);
        2. else wait for the oldest plan's result and update from it, as ``step`` does.

        A structured request needs its grammar's mask, and the mask needs the token a step
        in flight is still sampling: such a plan waits for that step (its update) before
        its mask is made and it is sent, so grammars cost the overlap, not correctness.
        A step that raised: every plan in flight is waited for and undone, oldest first;
        while fault isolation looks for the request at fault, the steps are synchronous."""
        self._last_step = None
        queue = self.batch_queue
        assert queue is not None
        if self.fault_isolation is not None and self.fault_isolation.active:
            # Finding the request at fault retries one suspect per step: one plan at a time.
            return self._finish_oldest()[0] if queue else self.step()
        if self.scheduler.has_unfinished_requests() and len(queue) < self.batch_queue_size:
            plan, grammar_rows = self._plan()
            finished = None
            if queue and any(self.scheduler.requests[r].num_output_placeholders > 1 for r in grammar_rows):
                # The older step's tokens advance the grammars this plan needs (or end the
                # reasoning that keeps one from being in force yet). Should that
                # step fail, this plan (made on top of it) is undone with it and not sent.
                finished, failed = self._finish_oldest(unsent=plan)
                if failed:
                    return finished
            self._send(self._with_grammar_bitmask(plan, grammar_rows))
            if finished is not None:
                return finished
            if len(queue) < self.batch_queue_size and plan.total_num_scheduled_tokens > 0:
                return None
        if not queue:
            return None
        return self._finish_oldest()[0]

    def _send(self, plan: SchedulerOutput) -> None:
        assert self.batch_queue is not None
        traced = self.tracer.begin(plan) if self.tracer is not None else None
        self.batch_queue.append((plan, traced, self._execute_thread.submit(self.executor.execute_model, plan)))

    def _finish_oldest(self, unsent: SchedulerOutput | None = None) -> tuple[EngineCoreOutputs, bool]:
        """Wait for the oldest plan in flight and update from it; (its outputs, whether it
        failed). A failure undoes every later plan too, ``unsent`` (made, not sent) last."""
        assert self.batch_queue is not None
        plan, traced, future = self.batch_queue.popleft()
        try:
            model_output = future.result()
        except BaseException as error:
            # Steps run in order: the later ones ran on half-done state. Undo them all.
            undone = [plan]
            while self.batch_queue:
                later, _, later_future = self.batch_queue.popleft()
                try:
                    later_future.result()
                except BaseException:  # noqa: BLE001 - undone below whatever it did
                    pass
                undone.append(later)
            for each in undone + ([unsent] if unsent is not None else []):
                self.scheduler.undo_failed_step(each)
            return EngineCoreOutputs(self._isolate_or_raise(plan, error), self.make_stats(plan), time.monotonic()), True
        return self.update_from_output(plan, model_output, traced), False

    def schedule(self) -> SchedulerOutput:
        """The scheduler's plan, plus the grammar masks of the structured requests in it."""
        plan, grammar_rows = self._plan()
        return self._with_grammar_bitmask(plan, grammar_rows)

    def _plan(self) -> tuple[SchedulerOutput, list[str]]:
        """The scheduler's plan, and its structured requests that sample a token in it."""
        if self.fault_isolation is not None:
            self.fault_isolation.limit_admissions(self.scheduler)
        plan = self.scheduler.schedule()
        # Prefix caching, vLLM's counters: the tokens of each request admitted (or resumed
        # after a preemption) were looked up; this many were found cached. Summed until
        # the next stats read them (async scheduling plans twice before one update).
        requests = self.scheduler.requests
        queries, hits = self._prefix_cache_counts
        self._prefix_cache_counts = (queries + sum(requests[r].num_tokens for r in plan.num_prefix_hit_tokens),
                                     hits + sum(plan.num_prefix_hit_tokens.values()))
        grammars = self.structured_output_manager.grammars
        rows = [rid for rid in plan.num_scheduled_tokens
                if rid in grammars and not requests[rid].is_prefill_chunk] if grammars else []
        return plan, rows

    def update_from_output(self, plan: SchedulerOutput, model_output, traced=None) -> EngineCoreOutputs:
        """The step's tokens into the scheduler (which finishes and frees); the grammars
        take them; the sampler's logprobs join each request's output."""
        core_outputs = self.scheduler.update_from_output(
            plan, model_output.sampled_token_ids, model_output.spec_token_ids,
            **({"kv_connector_output": model_output.kv_connector_output}
               if model_output.kv_connector_output is not None else {}))
        if self.fault_isolation is not None:
            self.fault_isolation.passed(core.request_id for core in core_outputs)
        core_outputs, failed = self._advance_grammars(core_outputs, plan)
        logprobs = model_output.logprobs
        prompt_logprobs = dict(model_output.prompt_logprobs or {})   # a copy: the runner's stays whole
        outputs = []
        for core in core_outputs:
            prompt_rows = prompt_logprobs.pop(core.request_id, None)
            if core.request_id in logprobs or prompt_rows is not None:
                core = dataclasses.replace(core, new_logprobs=logprobs.get(core.request_id),
                                           new_prompt_logprobs=prompt_rows)
            outputs.append(core)
        # What is left: prompt logprobs of a chunk that sampled nothing (not the prompt's last).
        outputs += [EngineCoreOutput(rid, (), new_prompt_logprobs=lists)
                    for rid, lists in prompt_logprobs.items()]
        outputs += failed + self._fail_connector_casualties()   # a connector call of this update raised
        self._forget_finished_grammars()
        if self.tracer is not None:
            self._last_step = (plan, traced, core_outputs, model_output, [])
            self._record_step()
        if self.debug_invariants:
            self.scheduler.check_invariants()
        self.num_steps += 1
        stats = self.make_stats(plan, model_output.expert_load)
        self._publish_kv_events()
        return EngineCoreOutputs(outputs, stats, time.monotonic())

    def make_stats(self, plan: SchedulerOutput | None = None,
                   expert_load: dict[str, list[int]] | None = None) -> SchedulerStats:
        """The core's state after a step (``core/stats.py``): what metrics read."""
        scheduler = self.scheduler
        stats = SchedulerStats(num_running_reqs=len(scheduler.running),
                               num_waiting_reqs=scheduler.num_waiting_requests(),
                               kv_cache_usage=self.kv_cache_manager.usage,
                               expert_load=dict(expert_load or {}))
        if plan is not None:   # counted at schedule(), before the step's tokens were appended
            stats.prefix_cache_queries, stats.prefix_cache_hits = self._prefix_cache_counts
            self._prefix_cache_counts = (0, 0)
        if self.config.speculative_config is not None:
            stats.spec_decoding = dataclasses.replace(
                scheduler.spec_decoding_stats,
                num_accepted_tokens_per_pos=list(scheduler.spec_decoding_stats.num_accepted_tokens_per_pos))
        connector = scheduler.connector
        if plan is not None and connector is not None:   # a step's: what it moved since the last
            # Only a connector with a tier of its own counts blocks (OffloadingConnector).
            moved = (getattr(connector, "num_blocks_loaded", 0), getattr(connector, "num_blocks_saved", 0))
            stats.kv_blocks_loaded, stats.kv_blocks_saved = moved[0] - self._kv_moved[0], moved[1] - self._kv_moved[1]
            self._kv_moved = moved
        return stats

    def _record_step(self, redo: bool = False) -> None:
        """The step trace's record of the last step; ``redo``: made again, after the front
        end ended some of its requests (a stop string in their text, found after the step)."""
        assert self.tracer is not None and self._last_step is not None
        plan, traced, core_outputs, model_output, stopped = self._last_step
        record = self.tracer.redo_last if redo else self.tracer.record
        record(plan, traced, core_outputs, stopped, sampled_token_ids=model_output.sampled_token_ids,
               expert_load=model_output.expert_load)

    @property
    def trace(self):
        return self.tracer.trace if self.tracer is not None else None

    def _publish_kv_events(self) -> None:
        """Send the block pool's events since the last batch as one ``KVEventBatch`` (vLLM:
        ``Scheduler.update_from_output``); nothing when events are off or none happened.
        A step that raised leaves its events queued: the next batch carries them, in order."""
        if self.kv_event_publisher is None:
            return
        events = self.kv_cache_manager.take_events()
        if events:
            from microvllm.distributed.kv_events import KVEventBatch, to_wire
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=[to_wire(e) for e in events]))

    # ------------------------------------------------- structured outputs
    def _with_grammar_bitmask(self, plan, rows: list[str]):
        """The plan, plus the token bitmask of ``rows``: its structured requests that sample
        a token this step (their chunk reaches their last token), that still run (async
        scheduling: a step's update in between may have finished one) and whose grammar is
        in force (past the reasoning, with a reasoning parser); unchanged when there are none."""
        manager = self.structured_output_manager
        rows = [rid for rid in rows if rid in manager.grammars and manager.should_fill_bitmask(rid)]
        if not rows:
            return plan
        return dataclasses.replace(plan, structured_output_request_ids=tuple(rows),
                                   grammar_bitmask=manager.grammar_bitmask(rows))

    def _advance_grammars(self, core_outputs, plan=None) -> tuple[list, list]:
        """Each structured request's matcher takes its new tokens. A grammar that is
        complete (it accepted EOS where it may end, with ``ignore_eos`` on so the
        scheduler went on) finishes its request: "stop", as EOS would. A token the
        grammar refuses is never output: its request fails (``_fail_grammar``). So does
        a token sampled from a mask row that allowed nothing (every logit was -inf, so
        the sampler's pick, id 0, means nothing), even if the grammar would take it: a
        mask that disagrees with its grammar (a wrong ``TokenTrie``) must not pass id 0 off
        as output. Returns (the outputs to pass on, the outputs of the requests that failed)."""
        manager = self.structured_output_manager
        if not manager.grammars:
            return core_outputs, []
        empty_rows = set()
        if plan is not None and plan.grammar_bitmask is not None:
            empty = allows_nothing(plan.grammar_bitmask, manager.vocab_size).tolist()
            empty_rows = {rid for rid, none in zip(plan.structured_output_request_ids, empty) if none}
        result, failed = [], []
        for core in core_outputs:
            # With a reasoning parser, only what follows the reasoning (tokens_for_grammar).
            taken = (manager.tokens_for_grammar(core.request_id, list(core.new_token_ids))
                     if core.request_id in manager.grammars else [])
            if taken:
                if (core.request_id in empty_rows
                        or not manager.accept_tokens(core.request_id, taken)):
                    failed.append(self._fail_grammar(core.request_id, taken))
                    continue
                if manager.is_terminated(core.request_id) and core.finish_reason is None:
                    self.scheduler.finish_requests(core.request_id, RequestStatus.FINISHED_STOPPED)
                    core = dataclasses.replace(core, finish_reason="stop")
            result.append(core)
        return result, failed

    def _fail_grammar(self, request_id: str, token_ids: list[int]) -> EngineCoreOutput:
        """A request drew ``token_ids``, which its grammar refuses. The mask allowed nothing
        (a grammar that dead-ends, e.g. regex ``a[^\\s\\S]`` after "a"), or the request's
        other rules (min_tokens, bad_words, allowed_token_ids) forbade all it allowed, so
        every logit was -inf. As in vLLM (``FINISHED_ERROR``), it ends with
        ``finish_reason="error"`` and the reason; the refused tokens are never output
        (the front end fails the other samples of its prompt)."""
        manager = self.structured_output_manager
        request = self.scheduler.requests.get(request_id)   # None if this step also ended it
        num_before = request.num_output_tokens - len(token_ids) if request is not None else None
        after = "here" if num_before is None else f"after {num_before} generated token{'s' * (num_before != 1)}"
        if manager.allows_nothing(manager.grammars[request_id]):
            reason = (f"structured_outputs: the grammar allows no token {after}, not even the end of "
                      "the text: no continuation of the output so far can match it")
            logger.warning("request %r: %s", request_id, reason)
        else:
            reason = (f"structured_outputs: every token the grammar allows {after} is forbidden by the "
                      "request's other rules (min_tokens, bad_words, allowed_token_ids, logit_bias)")
            logger.error("request %r sampled %s, which its grammar refuses: %s (or the sampler ignored "
                         "the grammar bitmask)", request_id, token_ids, reason)
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        return EngineCoreOutput(request_id, (), finish_reason="error", error=reason, bad_request=True)

    def _forget_finished_grammars(self) -> None:
        manager = self.structured_output_manager
        for request_id in [r for r in manager.grammars if r not in self.scheduler.requests]:
            manager.remove(request_id)

    def _fail_connector_casualties(self) -> list[EngineCoreOutput]:
        """Fail the requests whose KV connector call raised (``Scheduler._maybe_start_kv_load``):
        their caller hears why; their blocks are freed; the core goes on."""
        if self.scheduler.connector is None:
            return []
        failures = self.scheduler.take_connector_failures()
        for request_id in failures:
            self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        if failures:
            self._forget_finished_grammars()
        return [EngineCoreOutput(rid, (), finish_reason="error", error=why) for rid, why in failures.items()]

    def _isolate_or_raise(self, plan, error: BaseException) -> list[EngineCoreOutput]:
        """After a failed step's work was undone: serving, fail the request at fault; else
        (offline, Ctrl-C, a dead worker: the core's state unknown) raise the error."""
        if (self.fault_isolation is None or not isinstance(error, Exception)
                or isinstance(error, FATAL_ERRORS)):
            raise error
        return self._isolate_fault(plan, error)

    def _isolate_fault(self, plan, error: Exception) -> list[EngineCoreOutput]:
        """A step raised (its work is undone): fail the request it can be pinned on, or
        retry the step's requests one suspect at a time (``engine/fault_isolation.py``)."""
        assert self.fault_isolation is not None
        culprit = self.fault_isolation.blame(plan)
        if culprit is None:
            logger.warning("an engine step of %d requests failed (%r): retrying them one at a time "
                           "to find the one at fault", len(plan.num_scheduled_tokens), error)
            return []
        logger.error("request %r failed inside an engine step; the engine goes on", culprit, exc_info=error)
        self.scheduler.finish_requests(culprit, RequestStatus.FINISHED_ABORTED)
        self._forget_finished_grammars()
        if self.debug_invariants:
            self.scheduler.check_invariants()
        return [EngineCoreOutput(culprit, (), finish_reason="error",
                                 error=f"the request failed inside an engine step: {type(error).__name__}: {error}")]

    # ------------------------------------------------------------- utility
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache; see ``Scheduler.reset_prefix_cache``. With KV events on,
        routers hear ``AllBlocksCleared`` at once, not at the next step."""
        self._last_step = None
        reset = self.scheduler.reset_prefix_cache(reset_running_requests)
        self._publish_kv_events()
        return reset

    def check_invariants(self) -> None:
        """Block pool accounting and the scheduler's bookkeeping."""
        self.scheduler.check_invariants()

    def shutdown(self) -> None:
        """Stop the executor's worker processes (with ``tensor_parallel_size > 1``), the
        execute thread (async scheduling) and the KV event publisher's thread and sockets
        (idempotent)."""
        if self.kv_event_publisher is not None:
            self._stop_kv_event_publisher()
        if self.batch_queue is not None:
            self._execute_thread.shutdown(wait=True, cancel_futures=True)
        self.executor.shutdown()
