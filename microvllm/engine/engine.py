"""Engine: the step loop that ties scheduler, executor and output processing together.

    EngineArgs.create_engine_config() ──> EngineConfig (every "auto" settled; frozen)
    __init__(config, components=, trace=, debug_invariants=):
              platform ──> Executor (loads the model: here, or in tensor_parallel_size
              worker processes, one shard each) ──> _initialize_kv_caches (how many
              blocks fit: the executor measures) ──> KV cache manager, Scheduler

    add_request(id, prompt, params)
        process_request: every check and the tokenizer (the one validation)
        add_processed_request ──> Request (WAITING) ──> Scheduler
    step():
        plan    = scheduler.schedule()                 who computes how many tokens
        sampled = executor.execute_model(plan)         one forward pass, then sampling
                  (raises: scheduler.undo_failed_step(plan), then re-raise; when
                  serving, any error but Ctrl-C or a dead worker fails only the
                  request at fault: engine/fault_isolation.py)
        core    = scheduler.update_from_output(plan, sampled)   append, stop checks, free
        outputs = output_processor.process(core)       detokenize, stop strings, n > 1
        trace.record(...)                              only when tracing is on
        return outputs                                 RequestOutput per request that moved

The engine never touches a tensor (the executor's worker owns them all) and never
a block (the scheduler's KV cache manager does).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from microvllm import envs
from microvllm.config import EngineConfig
from microvllm.config.components import check_components, component
from microvllm.core.block_pool import BlockPool
from microvllm.core.kv_cache_manager import KVCacheManager, PoolTooSmallError
from microvllm.core.request import Request, RequestStatus
from microvllm.core.scheduler import Scheduler
from microvllm.detokenizer import IncrementalDetokenizer
from microvllm.distributed.kv_transfer.kv_connector.base import KVConnectorRole
from microvllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from microvllm.distributed.kv_transfer.kv_transfer_params import check_kv_transfer_params
from microvllm.engine.fault_isolation import FaultIsolation
from microvllm.engine.output_processor import OutputProcessor
from microvllm.engine.outputs import RequestOutput
from microvllm.engine.param_checks import check_params_for_model
from microvllm.engine.prompts import PromptProcessor
from microvllm.engine.step_tracer import StepTracer
from microvllm.executor import get_executor_class
from microvllm.executor.multiproc_executor import WorkerError
from microvllm.platforms import platform_for
from microvllm.profiler import TorchProfiler
from microvllm.sampling_params import SamplingParams
from microvllm.structured_output import StructuredOutputManager
from microvllm.structured_output.backend_regex import TokenTrie
from microvllm.structured_output.bitmask import allows_nothing

logger = logging.getLogger(__name__)

# Errors after which the engine's state is unknown (a worker process died): they stop
# the engine instead of failing one request (``engine/fault_isolation.py``).
FATAL_ERRORS: tuple[type[BaseException], ...] = (WorkerError,)


@dataclass(frozen=True)
class ProcessedRequest:
    """A request that passed every check: adding it can no longer fail."""

    request_id: str
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    grammars: list | None = None   # structured outputs: one compiled matcher per sample


class Engine:
    """Built from a frozen ``EngineConfig`` (``EngineArgs.create_engine_config()``; or
    ``Engine.from_engine_args``) and, beside it, the course's hooks: ``components`` (your
    classes in place of the engine's, ``config/components.py``), ``trace`` (record every
    step for the widgets) and ``debug_invariants`` (check the bookkeeping after every step).
    The engine reads the config and writes to none of it."""

    def __init__(self, config: EngineConfig, *, components: dict[str, type] | None = None,
                 trace: bool = False, debug_invariants: bool = False):
        check_components(components)
        self.config = config
        self.components = components
        self.debug_invariants = debug_invariants
        model_config, cache_config, parallel = config.model_config, config.cache_config, config.parallel_config
        self.model_path = model_config.model_path
        self.platform = platform_for(config.device_config)
        self.prompts = PromptProcessor.from_model_folder(self.model_path,
                                                         vocab_size=model_config.hf_config.vocab_size)
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
        self.scheduler = component(components, "scheduler", Scheduler)(
            config.scheduler_config, self.kv_cache_manager,
            **({"kv_connector": kv_connector} if kv_connector is not None else {}))
        self.structured_output_manager = StructuredOutputManager(
            self.prompts.tokenizer, model_config.hf_config.vocab_size,
            config.structured_outputs_config.structured_outputs_backend,
            token_trie=component(components, "token_trie", TokenTrie),   # the course backend's vocabulary trie
            limits=config.structured_outputs_config, cache_bytes=envs.xgrammar_cache_bytes())
        self.output_processor = OutputProcessor(
            self.prompts.tokenizer, component(components, "detokenizer", IncrementalDetokenizer))
        # Mixtures of experts: (token, expert) pairs each MoE layer routed to each expert,
        # since the engine started ({layer index: [count per expert]}; LLM.get_metrics()).
        self.expert_load: dict[str, list[int]] = {}
        # Prefix caching, vLLM's counters: tokens looked up when requests were admitted (or
        # resumed after a preemption), and how many of them were found cached.
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.tracer = StepTracer(self.scheduler, model_config.hf_config.vocab_size) if trace else None
        # Serving (AsyncLLM) sets a FaultIsolation here: a step's exception then fails
        # only the request at fault. Offline (None) it is raised, as vLLM's LLM does.
        self.fault_isolation: FaultIsolation | None = None
        self.num_steps = 0
        self.profiler: TorchProfiler | None = None
        # KV cache events for a router (distributed/kv_events.py): the block pool's events
        # of each step go out as one batch. Started last: nothing after it can fail.
        self.kv_event_publisher = None
        if kv_events:
            from microvllm.distributed.kv_events import EventPublisherFactory as Publishers
            self.kv_event_publisher = Publishers.create(config.kv_events_config, parallel.data_parallel_rank)
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
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Validate and queue one prompt. ``prompt``: a string, ``{"prompt_token_ids": [...]}``
        or ``{"prompt": "..."}``. With ``params.n > 1`` it becomes n child requests that
        share the prompt's blocks through the prefix cache."""
        self.add_processed_request(self.process_request(request_id, prompt, params))

    def process_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                        *, name: str | None = None, grammars: list | None = None) -> ProcessedRequest:
        """Every check a request must pass, and its tokens; changes nothing. ``name``: what
        errors call it (``LLM.generate`` checks all its prompts first, as "prompts[2]").
        ``grammars``: its structured-output matchers, compiled already (a server compiles
        them in worker processes); otherwise they are compiled here."""
        token_ids: list[int] | None = None
        try:
            processed = self._process_request(request_id, prompt, params, name=name, grammars=grammars)
            token_ids = processed.token_ids
            kv_transfer_params = (processed.params.extra_args or {}).get("kv_transfer_params")
            if kv_transfer_params is not None:   # from a request body: untrusted
                check_kv_transfer_params(kv_transfer_params)
                if self.scheduler.connector is not None:   # e.g. a producer the operator did not allow
                    self.scheduler.connector.check_request(kv_transfer_params, processed.token_ids)
            return processed
        except ValueError:
            kv_transfer_params = _kv_transfer_params(params) if isinstance(params, SamplingParams) else None
            if kv_transfer_params is not None and self.scheduler.connector is not None:
                if token_ids is None:   # refused before it was tokenized: the release needs its tokens
                    try:
                        token_ids = self.tokenize_prompt(prompt, params)[1]   # type: ignore[arg-type]
                    except Exception:  # noqa: BLE001 - then the peer frees on its timeout
                        token_ids = None
                self.scheduler.connector.request_refused(kv_transfer_params, token_ids)
            raise

    def _process_request(self, request_id: str, prompt, params: SamplingParams | None, *,
                         name: str | None, grammars: list | None) -> ProcessedRequest:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.verify()  # again: a field may have been set after construction
        check_params_for_model(params, self.prompts.vocab_size, self.config.model_config.max_logprobs)
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id={request_id!r} must be a non-empty string")
        # The n > 1 samples get ids "0_7", "1_7", ...: those must be free too.
        taken = self.output_processor.ids_in_use(request_id, params.n)
        if taken:
            raise ValueError(f"request_id={request_id!r} is already in use (unfinished: {taken}): "
                             "give each request a unique id (or wait until it finishes)")
        text, token_ids = self.tokenize_prompt(prompt, params, name=name or request_id)
        if params.bad_words:
            params = params.clone()   # the caller's object stays as it was
            params.bad_words_token_ids = self.prompts.bad_words_token_ids(params.bad_words)
        self._check_fits(name or request_id, token_ids)
        if params.structured_outputs is not None:
            if grammars is None:
                grammars = self.structured_output_manager.compile(params, params.n)
            self.structured_output_manager.check_can_start(params, grammars[0])   # all n are alike
        return ProcessedRequest(request_id, text, token_ids, params, grammars)

    def tokenize_prompt(self, prompt, params: SamplingParams, *,
                        name: str | None = None) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt, truncated as ``params.truncate_prompt_tokens`` asks.
        Changes nothing, so a server may call it on another thread. A text far too long
        for ``max_model_len`` is refused before it is tokenized (that alone could take
        seconds): it needs at least len(text) / (the longest token's length) tokens."""
        truncate = params.truncate_prompt_tokens
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
            text = prompt.get("prompt")
        if isinstance(text, str) and truncate is None:
            self.check_text_fits(len(text), f"request {name!r}: the prompt" if name else "prompt",
                                 "the prompt (or set truncate_prompt_tokens)")
        text, token_ids = self.prompts.process(prompt)
        if truncate is not None:
            keep = self.config.scheduler_config.max_model_len - 1 if truncate == -1 else truncate
            if len(token_ids) > keep:   # the last `keep` tokens: the end of a long text matters most
                token_ids = token_ids[-keep:]
                text = self.prompts.tokenizer.decode(token_ids, skip_special_tokens=False) \
                    if self.prompts.tokenizer is not None else None
        return text, token_ids

    def check_text_fits(self, num_chars: int, which: str, shorten: str = "it") -> None:
        """``ValueError`` if ``num_chars`` characters of text cannot fit ``max_model_len``,
        known before tokenizing them (that alone could take seconds): they need at least
        ``num_chars`` / (the longest token's characters) tokens."""
        if self.prompts.tokenizer is None:   # no text to tokenize at all
            return
        min_tokens = num_chars // self.prompts.max_token_chars
        max_model_len = self.config.scheduler_config.max_model_len
        if min_tokens >= max_model_len:
            raise ValueError(f"{which} has {num_chars:,} characters, so at least {min_tokens:,} tokens, but "
                             f"max_model_len is {max_model_len}: shorten {shorten}")

    def add_processed_request(self, request: ProcessedRequest) -> None:
        """Queue a request ``process_request`` accepted: nothing here can fail half-way."""
        request_id, text, token_ids, params = request.request_id, request.text, request.token_ids, request.params
        child_ids = self.output_processor.add(request_id, text, token_ids, params)
        if self.tracer is not None:
            for child_id in child_ids:
                self.tracer.add_prompt(child_id, text)
        for child_id, grammar in zip(child_ids, request.grammars or ()):
            self.structured_output_manager.add(child_id, grammar)
        now = time.monotonic()
        # Prompt logprobs need every prompt position computed, never read from the
        # prefix cache: a salt of the request's own makes every first lookup miss.
        salt = f"prompt_logprobs:{uuid.uuid4().hex}" if params.prompt_logprobs is not None else None
        for index, child_id in enumerate(child_ids):
            self.scheduler.add_request(Request(
                child_id, token_ids, _child_params(params, index),
                eos_token_id=self.prompts.eos_token_id, block_size=self.config.cache_config.block_size,
                arrival_time=now, cache_salt=salt))

    def _check_fits(self, request_id: str, token_ids: list[int]) -> None:
        """Raise if this prompt could never run: too long for ``max_model_len`` (with room for
        one new token), or for the whole pool (in chunks of at most one step's budget)."""
        max_len = self.config.scheduler_config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"request {request_id!r}: the prompt has {len(token_ids)} tokens but "
                             f"max_model_len is {max_len} (room is needed for at least one new "
                             "token): shorten the prompt or raise max_model_len")
        # The prompt (in chunks of at most one step's budget) plus one new token must fit
        # in the pool on its own, or it never runs.
        manager = self.kv_cache_manager
        num_blocks = manager.num_blocks_to_start(len(token_ids),
                                                 self.config.scheduler_config.max_num_batched_tokens)
        if num_blocks > manager.num_usable_blocks:
            raise PoolTooSmallError(request_id, len(token_ids) + 1, num_blocks,
                                    manager.num_usable_blocks, self.config.cache_config.block_size)

    def abort_request(self, request_id: str | Iterable[str]) -> bool:
        """Stop a request (all its samples) and free its blocks; ``request_id`` may also be
        a list of ids (as in vLLM). Aborting an unknown or already finished id is a no-op;
        returns whether any request was still running (it may have just finished)."""
        if not isinstance(request_id, str):
            return any([self.abort_request(one) for one in request_id])  # a list: abort all
        return self.abort_with_output(request_id) is not None

    def abort_with_output(self, request_id: str) -> RequestOutput | None:
        """Abort one request as ``abort_request`` does; return its final output (its
        unfinished samples with ``finish_reason="abort"``), or None if it was not running."""
        child_ids = self.output_processor.child_ids(request_id)
        if not child_ids:
            return None
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        self._forget_finished_grammars()
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.num_unfinished()

    # ---------------------------------------------------------------- step
    def step(self):
        """Run one engine step; return a ``RequestOutput`` for every request that changed."""
        if self.fault_isolation is not None:
            self.fault_isolation.limit_admissions(self.scheduler)
        failed_by_connector = self._fail_connector_casualties()   # never scheduled
        plan = self._with_grammar_bitmask(self.scheduler.schedule())
        for request_id, num_hit_tokens in plan.num_prefix_hit_tokens.items():
            self.prefix_cache_queries += self.scheduler.requests[request_id].num_tokens
            self.prefix_cache_hits += num_hit_tokens
        traced = self.tracer.begin(plan) if self.tracer is not None else None
        try:
            runner_output = self.executor.execute_model(plan)
        except BaseException as error:
            # Ctrl-C (KeyboardInterrupt) or an error inside the model: this step's KV
            # may be half written. The scheduler puts the step's requests back to be
            # recomputed, so the engine stays consistent and usable.
            self.scheduler.undo_failed_step(plan)
            if (self.fault_isolation is None or not isinstance(error, Exception)
                    or isinstance(error, FATAL_ERRORS)):
                raise
            return failed_by_connector + self._isolate_fault(plan, error)
        core_outputs = self.scheduler.update_from_output(
            plan, runner_output.sampled_token_ids, runner_output.spec_token_ids,
            **({"kv_connector_output": runner_output.kv_connector_output}
               if runner_output.kv_connector_output is not None else {}))
        if self.fault_isolation is not None:
            self.fault_isolation.passed(core.request_id for core in core_outputs)
        core_outputs, failed = self._advance_grammars(core_outputs, plan)
        outputs, stopped = self.output_processor.process(core_outputs, runner_output.logprobs,
                                                         runner_output.prompt_logprobs)
        outputs.extend(failed)
        if stopped:  # stop strings, found by the detokenizer
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        outputs.extend(failed_by_connector + self._fail_connector_casualties())
        self._forget_finished_grammars()
        if self.tracer is not None:
            self.tracer.record(plan, traced, core_outputs, stopped,
                               sampled_token_ids=runner_output.sampled_token_ids,
                               expert_load=runner_output.expert_load)
        for layer, counts in runner_output.expert_load.items():   # mixtures of experts
            total = self.expert_load.setdefault(layer, [0] * len(counts))
            self.expert_load[layer] = [a + b for a, b in zip(total, counts)]
        if self.debug_invariants:
            self.check_invariants()
        self.num_steps += 1
        self._publish_kv_events()
        return outputs

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
    def _with_grammar_bitmask(self, plan):
        """The plan, plus the token bitmask of the structured requests that sample a token
        this step (their chunk reaches their last token); unchanged when there are none."""
        manager = self.structured_output_manager
        if not manager.grammars:
            return plan
        requests = self.scheduler.requests
        rows = [rid for rid in plan.num_scheduled_tokens if rid in manager.grammars
                and requests[rid].num_computed_tokens >= requests[rid].num_tokens]
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
        as output. Returns (the core outputs to process, the outputs of the requests that failed)."""
        manager = self.structured_output_manager
        if not manager.grammars:
            return core_outputs, []
        empty_rows = set()
        if plan is not None and plan.grammar_bitmask is not None:
            empty = allows_nothing(plan.grammar_bitmask, manager.vocab_size).tolist()
            empty_rows = {rid for rid, none in zip(plan.structured_output_request_ids, empty) if none}
        result, failed = [], []
        for core in core_outputs:
            if core.request_id in manager.grammars and core.new_token_ids:
                if (core.request_id in empty_rows
                        or not manager.accept_tokens(core.request_id, list(core.new_token_ids))):
                    output = self._fail_grammar(core.request_id, list(core.new_token_ids))
                    failed.extend([output] if output is not None else [])
                    continue
                if manager.is_terminated(core.request_id) and core.finish_reason is None:
                    self.scheduler.finish_requests(core.request_id, RequestStatus.FINISHED_STOPPED)
                    core = dataclasses.replace(core, finish_reason="stop")
            result.append(core)
        return result, failed

    def _fail_grammar(self, child_id: str, token_ids: list[int]) -> RequestOutput | None:
        """A sample drew ``token_ids``, which its grammar refuses. The mask allowed nothing
        (a grammar that dead-ends, e.g. regex ``a[^\\s\\S]`` after "a"), or the request's
        other rules (min_tokens, bad_words, allowed_token_ids) forbade all it allowed, so
        every logit was -inf. As in vLLM (``FINISHED_ERROR``), the whole request ends with
        ``finish_reason="error"`` and the reason; the refused tokens are never output."""
        request_id = self.output_processor.parent_id(child_id)
        if not self.output_processor.has(request_id):
            return None   # another sample of it failed earlier in this step
        manager = self.structured_output_manager
        request = self.scheduler.requests.get(child_id)   # None if this step also ended it
        num_before = request.num_output_tokens - len(token_ids) if request is not None else None
        after = "here" if num_before is None else f"after {num_before} generated token{'s' * (num_before != 1)}"
        if manager.allows_nothing(manager.grammars[child_id]):
            reason = (f"structured_outputs: the grammar allows no token {after}, not even the end of "
                      "the text: no continuation of the output so far can match it")
            logger.warning("request %r: %s", child_id, reason)
        else:
            reason = (f"structured_outputs: every token the grammar allows {after} is forbidden by the "
                      "request's other rules (min_tokens, bad_words, allowed_token_ids, logit_bias)")
            logger.error("request %r sampled %s, which its grammar refuses: %s (or the sampler ignored "
                         "the grammar bitmask)", child_id, token_ids, reason)
        self.scheduler.finish_requests(self.output_processor.child_ids(request_id), RequestStatus.FINISHED_ABORTED)
        return self.output_processor.fail(request_id, reason, bad_request=True)

    def _forget_finished_grammars(self) -> None:
        manager = self.structured_output_manager
        for request_id in [r for r in manager.grammars if r not in self.scheduler.requests]:
            manager.remove(request_id)

    def _fail_connector_casualties(self) -> list[RequestOutput]:
        """Fail the requests whose KV connector call raised (``Scheduler._maybe_start_kv_load``):
        their caller hears why; their blocks are freed; the engine goes on."""
        outputs: list[RequestOutput] = []
        if self.scheduler.connector is None:
            return outputs
        for child_id, why in self.scheduler.take_connector_failures().items():
            request_id = self.output_processor.parent_id(child_id)
            self.scheduler.finish_requests(self.output_processor.child_ids(request_id),
                                           RequestStatus.FINISHED_ABORTED)
            failed = self.output_processor.fail(request_id, why)
            if failed is not None:
                outputs.append(failed)
        if outputs:
            self._forget_finished_grammars()
        return outputs

    def _isolate_fault(self, plan, error: Exception) -> list:
        """A step raised (its work is undone): fail the request it can be pinned on, or
        retry the step's requests one suspect at a time (``engine/fault_isolation.py``)."""
        assert self.fault_isolation is not None
        culprit = self.fault_isolation.blame(plan)
        if culprit is None:
            logger.warning("an engine step of %d requests failed (%r): retrying them one at a time "
                           "to find the one at fault", len(plan.num_scheduled_tokens), error)
            return []
        request_id = self.output_processor.parent_id(culprit)
        logger.error("request %r failed inside an engine step; the engine goes on", request_id,
                     exc_info=error)
        self.scheduler.finish_requests(self.output_processor.child_ids(request_id),
                                       RequestStatus.FINISHED_ABORTED)
        failed = self.output_processor.fail(
            request_id, f"the request failed inside an engine step: {type(error).__name__}: {error}")
        if self.debug_invariants:
            self.check_invariants()
        return [failed] if failed is not None else []

    def shutdown(self) -> None:
        """Stop the executor's worker processes (with ``tensor_parallel_size > 1``); they
        also stop when the engine is garbage collected or the interpreter exits. Stops the
        KV event publisher's thread and sockets too (idempotent)."""
        if self.kv_event_publisher is not None:
            self._stop_kv_event_publisher()
        self.executor.shutdown()

    def check_invariants(self) -> None:
        """Block pool accounting + scheduler bookkeeping + output bookkeeping."""
        self.scheduler.check_invariants()
        unfinished = set(self.scheduler.requests)   # waiting, running, loading (checked above)
        self.output_processor.check_invariants(unfinished)

    @property
    def trace(self):
        return self.tracer.trace if self.tracer is not None else None

    # ------------------------------------------------------ vLLM's surface
    @classmethod
    def from_engine_args(cls, engine_args) -> "Engine":
        """Build an engine from ``EngineArgs`` (vLLM's ``LLMEngine.from_engine_args``): the
        resolved config, and the course's hooks beside it."""
        return cls(engine_args.create_engine_config(), components=engine_args.components,
                   trace=engine_args.trace, debug_invariants=engine_args.debug_invariants)

    def get_tokenizer(self):
        """The Hugging Face tokenizer (vLLM's ``get_tokenizer``); None for a folder without one."""
        return self.prompts.tokenizer.hf_tokenizer if self.prompts.tokenizer is not None else None

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache; see ``Scheduler.reset_prefix_cache``. With KV events on,
        routers hear ``AllBlocksCleared`` at once, not at the next step."""
        reset = self.scheduler.reset_prefix_cache(reset_running_requests)
        self._publish_kv_events()
        return reset

    def start_profile(self) -> None:
        """Start a torch.profiler trace (``microvllm/profiler.py`` says where it is written)."""
        if self.profiler is None:
            self.profiler = TorchProfiler(self.config.profiler_config)
        self.profiler.start()

    def stop_profile(self) -> Path:
        """Stop the trace and write it; returns the file's path."""
        if self.profiler is None:
            raise RuntimeError("stop_profile() without start_profile(): start a profile first")
        return self.profiler.stop()


# vLLM's name for the class that runs the step loop.
LLMEngine = Engine


def _kv_transfer_params(params: SamplingParams) -> dict | None:
    value = (params.extra_args or {}).get("kv_transfer_params")
    return value if isinstance(value, dict) else None


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index`` of an ``n > 1`` request: its own seed (seed + index), so the
    samples differ yet each stays reproducible."""
    if params.n == 1:
        return params
    return params.clone(n=1, seed=None if params.seed is None else params.seed + index)
