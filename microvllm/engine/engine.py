"""LLMEngine: the front end over an engine core (vLLM: ``vllm/v1/engine/llm_engine.py``).

    __init__(config, components=, trace=, debug_invariants=):
        PromptProcessor (the tokenizer)        InputProcessor  ──>  client  ──>  EngineCore
        OutputProcessor (detokenizers)              (engine/input_processor.py)  (engine/core.py:
                                                                      executor, KV cache, scheduler)
    add_request(id, prompt, params)
        input_processor.process: every check and the tokenizer (the one validation)
        add_processed_request ──> one EngineCoreRequest per sample ──> engine_core.add_request
    step():
        core    = engine_core.get_output()               one core step: schedule, execute, update
        outputs = output_processor.process(core.outputs)  detokenize, stop strings, n > 1
        engine_core.abort_requests(stopped, ...)          a stop string ends its sample in the core
        return outputs                                    RequestOutput per request that moved

The client is an ``InprocClient`` by default: the core runs in this process, one step
per ``step()`` call, so a notebook cell can step it and look inside (``engine.scheduler``,
``engine.kv_cache_manager``: the core's own). With ``VLLM_ENABLE_V1_MULTIPROCESSING=1``
(vLLM's default) it is a ``SyncMPClient``: the core steps by itself in a process of its
own, and ``step()`` takes its next step's outputs; with ``data_parallel_size=N`` (and no
rank: ``serve --data-parallel-size N``) a ``DPLBMPClient`` over N such cores. The front end never touches a block or
a tensor; the core never touches text.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from microvllm import envs
from microvllm.config import EngineConfig
from microvllm.config.components import component
from microvllm.core.stats import SchedulerStats
from microvllm.detokenizer import IncrementalDetokenizer
from microvllm.engine.core_client import DPLBMPClient, InprocClient, MPClient, SyncMPClient
from microvllm.engine.fault_isolation import FaultIsolation
from microvllm.engine.input_processor import InputProcessor, ProcessedRequest
from microvllm.engine.output_processor import OutputProcessor
from microvllm.engine.outputs import RequestOutput
from microvllm.engine.prompts import PromptProcessor
from microvllm.lora.request import LoRARequest
from microvllm.profiler import TorchProfiler
from microvllm.sampling_params import SamplingParams
from microvllm.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

__all__ = ["Engine", "LLMEngine", "ProcessedRequest"]


def _of_the_core(name: str) -> property:
    """``engine.<name>``: the ``EngineCore``'s own (in this process only)."""
    return property(lambda self: getattr(self.core, name), doc=f"The engine core's ``{name}``.")


class Engine:
    """Built from a frozen ``EngineConfig`` (``EngineArgs.create_engine_config()``; or
    ``Engine.from_engine_args``) and, beside it, the course's hooks, which go to the
    engine core: ``components`` (your classes in place of the engine's,
    ``config/components.py``), ``trace`` (record every step for the widgets) and
    ``debug_invariants`` (check the bookkeeping after every step). ``fault_isolation``:
    a step's exception fails only the request at fault (serving); off, it is raised.
    ``multiprocess``: the core in a process of its own (``SyncMPClient``); by default
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` decides (off: ``InprocClient``, this process).
    The engine reads the config and writes to none of it."""

    def __init__(self, config: EngineConfig, *, components: dict[str, type] | None = None,
                 trace: bool = False, debug_invariants: bool = False, fault_isolation: bool = False,
                 multiprocess: bool | None = None):
        self.config = config
        self.components = components
        self.debug_invariants = debug_invariants
        model_config = config.model_config
        self.model_path = model_config.model_path
        self.prompts = PromptProcessor.from_model_folder(self.model_path,
                                                         vocab_size=model_config.hf_config.vocab_size)
        self.output_processor = OutputProcessor(
            self.prompts.tokenizer, component(components, "detokenizer", IncrementalDetokenizer))
        if multiprocess is None:
            multiprocess = envs.enable_v1_multiprocessing()
        parallel = config.parallel_config
        data_parallel = parallel.data_parallel_size > 1 and not parallel.data_parallel_external_lb
        if data_parallel and not multiprocess:
            raise ValueError(f"data_parallel_size={parallel.data_parallel_size}: one engine core is one model "
                             "copy, and N of them run in processes of their own: set "
                             "VLLM_ENABLE_V1_MULTIPROCESSING=1 (AsyncLLM: multiprocess=True), or use `microvllm "
                             "serve --data-parallel-size N`; or run one LLM per process with data_parallel_rank=r, "
                             "each with its share of the prompts")
        self.engine_core: InprocClient | MPClient
        if multiprocess:
            check_multiprocess_hooks(components, trace)
            # The core in a process of its own: its checks cross the socket; grammars are
            # checked (compiled) here and compiled again, from the cache, there.
            client = DPLBMPClient if data_parallel else SyncMPClient
            self.engine_core = client(config, debug_invariants=debug_invariants, fault_isolation=fault_isolation)
            structured_output_manager = StructuredOutputManager(
                self.prompts.tokenizer, model_config.hf_config.vocab_size,
                config.structured_outputs_config.structured_outputs_backend,
                limits=config.structured_outputs_config, cache_bytes=envs.xgrammar_cache_bytes())
        else:
            # The core shares this process's tokenizer (it needs the EOS ids and, for
            # structured outputs, the vocabulary).
            inproc = InprocClient(config, components=components, trace=trace, debug_invariants=debug_invariants,
                                  fault_isolation=fault_isolation, prompts=self.prompts)
            self.engine_core = inproc
            structured_output_manager = inproc.engine_core.structured_output_manager
        self.input_processor = InputProcessor(
            config, self.prompts, core=self.engine_core, structured_output_manager=structured_output_manager,
            ids_in_use=self.output_processor.ids_in_use)
        # What the core's stats say, added up since the engine started (LLM.get_metrics()).
        # Prefix caching, vLLM's counters: tokens looked up when requests were admitted (or
        # resumed after a preemption), and how many of them were found cached.
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.prefix_cache_by_engine: dict[int, tuple[int, int]] = {}   # data-parallel core -> (queries, hits)
        # Mixtures of experts: (token, expert) pairs each MoE layer routed to each expert
        # ({layer index: [count per expert]}).
        self.expert_load: dict[str, list[int]] = {}
        self.scheduler_stats = SchedulerStats()   # the last step's
        self.profiler: TorchProfiler | None = None

    # The core's parts, for a learner who steps the engine by hand (in this process only).
    @property
    def core(self):
        """The ``EngineCore`` this engine steps (``engine/core.py``)."""
        if not isinstance(self.engine_core, InprocClient):
            raise AttributeError("the engine core runs in a process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1): "
                                 "its scheduler and KV cache cannot be read from here; unset it (or pass "
                                 "multiprocess=False) to step the core in this process")
        return self.engine_core.engine_core

    # Read through to the core (each raises with a core in another process, as ``core`` does).
    scheduler = _of_the_core("scheduler")
    kv_cache_manager = _of_the_core("kv_cache_manager")
    executor = _of_the_core("executor")
    platform = _of_the_core("platform")
    num_kv_blocks = _of_the_core("num_kv_blocks")
    structured_output_manager = _of_the_core("structured_output_manager")
    kv_event_publisher = _of_the_core("kv_event_publisher")
    tracer = _of_the_core("tracer")
    num_steps = _of_the_core("num_steps")

    @property
    def fault_isolation(self) -> FaultIsolation | None:
        return self.core.fault_isolation

    @fault_isolation.setter
    def fault_isolation(self, value: FaultIsolation | None) -> None:
        self.core.fault_isolation = value

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate and queue one prompt. ``prompt``: a string, ``{"prompt_token_ids": [...]}``
        or ``{"prompt": "..."}``. With ``params.n > 1`` it becomes n requests in the core
        that share the prompt's blocks through the prefix cache. ``lora_request``: the
        LoRA adapter it runs with (``enable_lora=True``)."""
        self.add_processed_request(self.process_request(request_id, prompt, params, lora_request=lora_request))

    def process_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                        *, name: str | None = None, grammars: list | None = None,
                        lora_request: LoRARequest | None = None,
                        reasoning_parser_kwargs: dict | None = None) -> ProcessedRequest:
        """Every check a request must pass, and its tokens; changes nothing
        (``InputProcessor.process``)."""
        return self.input_processor.process(request_id, prompt, params, name=name, grammars=grammars,
                                            lora_request=lora_request,
                                            reasoning_parser_kwargs=reasoning_parser_kwargs)

    def tokenize_prompt(self, prompt, params: SamplingParams, *,
                        name: str | None = None) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt (``InputProcessor.tokenize_prompt``)."""
        return self.input_processor.tokenize_prompt(prompt, params, name=name)

    def check_text_fits(self, num_chars: int, which: str, shorten: str = "it") -> None:
        self.input_processor.check_text_fits(num_chars, which, shorten)

    def add_processed_request(self, request: ProcessedRequest) -> None:
        """Queue a request ``process_request`` accepted: nothing here can fail half-way."""
        self.output_processor.add(request.request_id, request.text, request.token_ids, request.params)
        for core_request in self.input_processor.core_requests(request):
            self.engine_core.add_request(core_request)

    def abort_request(self, request_id: str | Iterable[str]) -> bool:
        """Stop a request (all its samples) and free their blocks; ``request_id`` may also be
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
        self.engine_core.abort_requests(child_ids)
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Any request still running, or (a core in this process) any work left in the core,
        such as blocks a KV connector is still saving."""
        return self.output_processor.num_unfinished() > 0 or self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.num_unfinished()

    # ---------------------------------------------------------------- step
    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """Run one engine step; return a ``RequestOutput`` for every request that changed.
        ``timeout``: a core in another process steps by itself; wait at most this long for
        its next step (none came: ``[]``)."""
        core_outputs = self.engine_core.get_output(timeout)
        if core_outputs is None:
            return []
        outputs, stopped, failed = self.output_processor.process(core_outputs.outputs)
        if stopped:   # stop strings, found by the detokenizer
            self.engine_core.abort_requests(stopped, stop_string=True)
        if failed:    # the other samples of a request the core failed
            self.engine_core.abort_requests(failed)
        if core_outputs.scheduler_stats is not None:
            self._record_stats(core_outputs.scheduler_stats, core_outputs.engine_index)
        if self.debug_invariants:
            self.check_invariants()
        return outputs

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if a core in another process died (vLLM's
        ``check_health``), even while no request waits for it."""
        if self.engine_core.dead_error is not None:
            raise self.engine_core.dead_error

    def get_stats(self) -> SchedulerStats:
        """The core's state now (a core in another process: as its last step left it)."""
        if isinstance(self.engine_core, InprocClient):
            return self.core.make_stats()
        return self.engine_core.latest_stats or self.scheduler_stats

    def stats_per_engine(self) -> list[SchedulerStats]:
        """Each data-parallel core's state as its last message said (one core: ``[get_stats()]``)."""
        if not isinstance(self.engine_core, DPLBMPClient):
            return [self.get_stats()]
        return [core.latest_stats or SchedulerStats() for core in self.engine_core.cores]

    def engine_index_of(self, request_id: str) -> int:
        """The data-parallel core that runs ``request_id`` (its first sample's; 0 with one core)."""
        child_ids = self.output_processor.child_ids(request_id)
        if not child_ids or not isinstance(self.engine_core, DPLBMPClient):
            return 0
        return self.engine_core.engine_index_of(child_ids[0])

    def _record_stats(self, stats: SchedulerStats, engine_index: int = 0) -> None:
        """Add a step's counts to the engine's totals (vLLM: the stat loggers)."""
        self.scheduler_stats = stats
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits
        queries, hits = self.prefix_cache_by_engine.get(engine_index, (0, 0))
        self.prefix_cache_by_engine[engine_index] = (queries + stats.prefix_cache_queries,
                                                     hits + stats.prefix_cache_hits)
        for layer, counts in stats.expert_load.items():   # mixtures of experts
            total = self.expert_load.setdefault(layer, [0] * len(counts))
            self.expert_load[layer] = [a + b for a, b in zip(total, counts)]

    def shutdown(self) -> None:
        """Stop the core: the executor's worker processes (with ``tensor_parallel_size >
        1``; they also stop when the engine is garbage collected or the interpreter
        exits) and the KV event publisher's thread and sockets (idempotent)."""
        self.engine_core.shutdown()

    def check_invariants(self) -> None:
        """Block pool accounting + scheduler bookkeeping + output bookkeeping: every
        sample the core holds is one the front end waits for, and no other. (A core in
        a process of its own checks its own, after every step, with ``debug_invariants``.)"""
        if not isinstance(self.engine_core, InprocClient):
            return
        self.core.check_invariants()
        unfinished = set(self.scheduler.requests)   # waiting, running, loading (checked above)
        self.output_processor.check_invariants(unfinished)

    @property
    def trace(self):
        return self.core.trace if isinstance(self.engine_core, InprocClient) else None

    # ------------------------------------------------------ vLLM's surface
    @classmethod
    def from_engine_args(cls, engine_args, *, fault_isolation: bool = False,
                         multiprocess: bool | None = None) -> "Engine":
        """Build an engine from ``EngineArgs`` (vLLM's ``LLMEngine.from_engine_args``): the
        resolved config, and the course's hooks beside it."""
        return cls(engine_args.create_engine_config(), components=engine_args.components,
                   trace=engine_args.trace, debug_invariants=engine_args.debug_invariants,
                   fault_isolation=fault_isolation, multiprocess=multiprocess)

    def get_tokenizer(self):
        """The Hugging Face tokenizer (vLLM's ``get_tokenizer``); None for a folder without one."""
        return self.prompts.tokenizer.hf_tokenizer if self.prompts.tokenizer is not None else None

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache; see ``Scheduler.reset_prefix_cache``. With KV events on,
        routers hear ``AllBlocksCleared`` at once, not at the next step."""
        return self.engine_core.reset_prefix_cache(reset_running_requests)

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


def check_multiprocess_hooks(components: dict | None, trace: bool) -> None:
    """The course's hooks need the core in this process: refuse them with a core in another."""
    if components:
        raise ValueError(f"components={sorted(components)}: your classes run in the engine core, and with "
                         "VLLM_ENABLE_V1_MULTIPROCESSING=1 that is another process, which cannot import a "
                         "class defined in a notebook: unset it (or pass multiprocess=False)")
    if trace:
        raise ValueError("trace=True records the core's steps in its own process: with "
                         "VLLM_ENABLE_V1_MULTIPROCESSING=1 that is another process; unset it (or pass "
                         "multiprocess=False)")


# vLLM's name for the front end that runs the step loop.
LLMEngine = Engine
