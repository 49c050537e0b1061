"""``AsyncLLM``: the online front end over the same ``Engine`` (vLLM: ``v1/engine/async_llm.py``).

The Engine is not thread-safe, so exactly one thread touches it: the engine-core
loop. Everyone else talks to that loop through a command queue, and hears back
through one asyncio queue per request::

    asyncio event loop (server)                 engine-core thread (the only Engine user)
    ───────────────────────────                 ─────────────────────────────────────────
    generate(prompt, params, id)
      a grammar (structured outputs): compiled in a compile worker process, within a
      time limit, killed if the client goes away (structured_output/compile_workers.py)
      engine.process_request on a tokenizer thread: every check, the tokenizer (slow
      work that would stall every stream if the engine thread or the event loop did it;
      tokenizer threads of their own, so that they never wait behind anything else)
      ── ("add", processed, future) ────────>   engine.add_processed_request
      <── future: accepted ───────────────────
      await queue.get()        <── RequestOutput (a snapshot) ──  engine.step() while unfinished
      ...                                        (sleeps on the command queue when idle)
    client gone: generate is cancelled
      ── ("abort", id) ─────────────────────>   engine.abort_request(id): its blocks are freed

With ``multiprocess=True`` (``microvllm serve``'s default) the engine's core runs in a
process of its own (``SyncMPClient``, ``engine/core_proc.py``): the thread above then only
feeds it and detokenizes, waiting at most ``COMMAND_POLL_S`` for each of its steps, while
the forward runs on the other process's cores, not under this process's GIL. (vLLM's
``AsyncMPClient`` does the same from an asyncio task.) With ``data_parallel_size=N`` the
same thread feeds N cores (``DPLBMPClient``: each request to the least loaded) and
``/metrics`` labels each core's samples ``engine="i"``.

Outputs are copied before they cross threads: the engine keeps mutating its own
``CompletionOutput`` objects step after step. The loop also keeps the serving
metrics (``ServingMetrics``: TTFT, inter-token latency, queue sizes) that
``/metrics`` shows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from microvllm.engine.arg_utils import EngineArgs, check_engine_options
from microvllm.engine.core_client import EngineDeadError
from microvllm.engine.engine import Engine
from microvllm.engine.metrics import PerEngineMetrics, ServingMetrics
from microvllm.engine.outputs import RequestOutput
from microvllm.lora.request import LoRARequest
from microvllm.sampling_params import RequestOutputKind, SamplingParams
from microvllm.structured_output.compile_workers import CompileCancelled, GrammarCompileWorkers

logger = logging.getLogger(__name__)

COMMAND_POLL_S = 0.02   # a core in another process: how long a wait for its outputs may delay a command


class RequestFailedError(RuntimeError):
    """This request failed inside an engine step; the engine goes on serving the others
    (``engine/fault_isolation.py``)."""


class RequestRejectedError(RequestFailedError, ValueError):
    """This request failed midway by its own fault: its grammar allows no token, or none
    that its other rules allow (``Engine._fail_grammar``). A ``ValueError`` too, so a
    server answers 400, as for any other request it cannot serve."""


class EngineClient:
    """What a server asks of an engine besides running requests: the tokenizer side, on
    threads of its own (vLLM: ``EngineClient``, ``vllm/engine/protocol.py``). ``AsyncLLM``
    is one; it sets ``engine`` (whose ``prompts`` and ``tokenize_prompt`` are used here),
    ``tokenizer_threads`` (``new_tokenizer_threads()``) and ``_stopping``."""

    engine: Any
    tokenizer_threads: concurrent.futures.ThreadPoolExecutor
    _stopping: threading.Event

    @property
    def stopping(self) -> bool:
        """True once ``shutdown()`` was called."""
        return self._stopping.is_set()

    def get_tokenizer(self):
        return self.engine.get_tokenizer()

    @property
    def tokenizer(self):
        return self.engine.prompts.tokenizer

    async def process_prompt(self, prompt, sampling_params: SamplingParams | None = None) -> dict:
        """Tokenize ``prompt`` on a tokenizer thread, not the engine's (a long prompt would
        stall every stream for as long as it takes): ``{"prompt", "prompt_token_ids"}``,
        which ``generate`` then takes as it is. Raises ``ValueError`` for a bad prompt."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        text, token_ids = await self.run_on_tokenizer_thread(
            functools.partial(self.engine.tokenize_prompt, prompt, params))
        return {"prompt": text, "prompt_token_ids": token_ids}

    async def run_on_tokenizer_thread(self, work):
        """``await`` ``work()`` run on one of the tokenizer threads (tokenize, detokenize,
        render a chat): never on the event loop, never behind a grammar compile."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_threads, work)


def new_tokenizer_threads() -> concurrent.futures.ThreadPoolExecutor:
    """Tokenizing and detokenizing for the server, on threads nothing else uses."""
    return concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="microvllm-tokenize")


class AsyncLLM(EngineClient):
    """An engine driven by a background thread; ``generate`` is an async generator.

        llm = AsyncLLM(model=None, max_num_seqs=16)        # same arguments as LLM()
        async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
            print(out.outputs[0].delta_text, end="")
        llm.shutdown()
    """

    def __init__(self, model: str | None = None, *, multiprocess: bool | None = None, **kwargs):
        check_engine_options(kwargs)
        self.engine_args = EngineArgs(model=model, **kwargs)
        # A server must outlive one bad request: a step's exception fails that request only.
        # multiprocess: the engine core in a process of its own (serve's default), this
        # thread then only feeds it and turns its outputs into text.
        self.engine = Engine.from_engine_args(self.engine_args, fault_isolation=True, multiprocess=multiprocess)
        num_engines = len(self.engine.stats_per_engine())   # data parallelism: N cores, one front end
        self.metrics: ServingMetrics | PerEngineMetrics = (
            ServingMetrics() if num_engines == 1 else PerEngineMetrics(num_engines))
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> (event loop, asyncio.Queue); touched by both threads, under the lock.
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self.dead_error: BaseException | None = None
        self.tokenizer_threads = new_tokenizer_threads()
        self._compile_workers: GrammarCompileWorkers | None = None   # started on first use
        self._compile_workers_lock = threading.Lock()
        # The engine-core loop's heartbeat: when it last finished a pass (a step or an idle
        # wait). /health reports the engine stuck when this grows old.
        self.last_heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run_engine_loop, name="microvllm-engine-core",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, multiprocess: bool | None = None) -> "AsyncLLM":
        return cls(**dataclasses.asdict(engine_args), multiprocess=multiprocess)

    # ------------------------------------------------------------ the API
    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.dead_error is None

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None,
                       lora_request: LoRARequest | None = None,
                       reasoning_parser_kwargs: dict | None = None) -> AsyncIterator[RequestOutput]:
        """Yield a ``RequestOutput`` each step this request moves; the last has
        ``finished=True``. ``sampling_params.output_kind`` says what each holds: all the
        text so far (CUMULATIVE, the default), only what is new (DELTA), or only the
        last one is yielded (FINAL_ONLY). A bad prompt or parameter raises ``ValueError`` / ``TypeError``
        before anything is yielded. Closing or cancelling the generator aborts the request.
        ``lora_request``: the LoRA adapter it runs with (``enable_lora=True``);
        ``reasoning_parser_kwargs``: a chat's template kwargs, which can switch thinking off."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running (it was shut down or failed)")
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id={request_id!r} is already in use: give each request a unique id")
            self._streams[request_id] = (loop, outputs)
        finished = False
        kind = sampling_params.output_kind if sampling_params is not None else RequestOutputKind.CUMULATIVE
        try:
            grammars = None
            if sampling_params is not None and sampling_params.structured_outputs is not None:
                grammars = await self.compile_grammars(sampling_params)
            # Every check and tokenizing: off the engine's thread and off the event loop.
            processed = await self.run_on_tokenizer_thread(functools.partial(
                self.engine.process_request, request_id, prompt, sampling_params, grammars=grammars,
                lora_request=lora_request, reasoning_parser_kwargs=reasoning_parser_kwargs))
            self._commands.put(("add", processed, accepted))
            await asyncio.wrap_future(accepted)
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"the engine failed: {out!r}") from out
                finished = out.finished
                if out.error is not None:
                    raise (RequestRejectedError if out.bad_request else RequestFailedError)(out.error)
                if kind == RequestOutputKind.DELTA:
                    yield _delta(out)
                elif kind == RequestOutputKind.CUMULATIVE or finished:
                    yield out
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:  # cancelled, closed early, or failed: free its blocks
                self._commands.put(("abort", request_id, None))

    async def compile_grammars(self, params: SamplingParams) -> list:
        """One matcher per sample for ``params.structured_outputs``: the limits and the
        cache checked on a tokenizer thread, the compile itself in a worker process within
        ``structured_outputs_compile_timeout``. ``ValueError`` for a spec that breaks a
        limit, does not compile, crashes the compiler or takes too long; cancelling the
        caller (the client went away) kills the compile."""
        manager = self.engine.input_processor.structured_output_manager
        job, grammars = await self.run_on_tokenizer_thread(functools.partial(manager.prepare, params, params.n))
        if grammars is None:
            try:
                blob = await self.compile_workers(manager.backend(job.kind)).compile(job)
            except CompileCancelled:   # not by our caller (that is CancelledError): by abort_all or shutdown
                raise EngineDeadError("the request was aborted before its grammar compiled (the server is "
                                      "shutting down)") from None
            grammars = await self.run_on_tokenizer_thread(functools.partial(
                manager.grammars_from, job, blob, params.n))
        return grammars

    def compile_workers(self, backend) -> GrammarCompileWorkers:
        """The grammar-compile processes, started with the first structured request."""
        with self._compile_workers_lock:
            if self._compile_workers is None:
                config = self.engine.config.structured_outputs_config
                self._compile_workers = GrammarCompileWorkers(
                    backend.spec_compiler(), num_workers=config.structured_outputs_compile_workers,
                    timeout=config.structured_outputs_compile_timeout)
            return self._compile_workers

    async def abort(self, request_id: str) -> None:
        """Abort a request by id (its generator then simply stops getting outputs)."""
        self._commands.put(("abort", request_id, None))

    def abort_all(self) -> None:
        """Abort every request in flight; each stream gets a last output with
        ``finish_reason="abort"`` (a server shutting down ends its streams this way).
        A request whose grammar is still compiling has its compile stopped."""
        with self._compile_workers_lock:
            if self._compile_workers is not None:
                self._compile_workers.cancel_all()
        self._commands.put(("abort_all", None, None))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash, on the engine's thread (vLLM's
        ``/reset_prefix_cache``); False while blocks are in use (nothing changed)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("reset_prefix_cache", None, done))
        return await asyncio.wrap_future(done)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight, stop the engine-core thread and wait for it; kill
        whatever grammar is compiling."""
        self._stopping.set()
        with self._compile_workers_lock:
            if self._compile_workers is not None:
                self._compile_workers.shutdown()
        self.tokenizer_threads.shutdown(wait=False, cancel_futures=True)
        self._commands.put(("wake", None, None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine-core thread did not stop within %.0f s", timeout)
        else:
            self.engine.shutdown()   # tensor parallelism: stop the worker processes

    # ---------------------------------------------- the engine-core thread
    def _run_engine_loop(self) -> None:
        try:
            while not self._stopping.is_set():
                # Idle: sleep until a command comes; busy: take what is queued, then step.
                self.last_heartbeat = time.monotonic()
                self._handle_commands(block=not self.engine.has_unfinished_requests())
                if self._stopping.is_set():
                    break
                self.engine.check_health()   # a core process that died while idle: the server stops
                if self.engine.has_unfinished_requests():
                    # A core in another process: wait a little for its next step, then look
                    # at the commands again (a new request, a client gone).
                    outputs = self.engine.step(timeout=COMMAND_POLL_S)
                    now = time.monotonic()
                    for out in outputs:
                        self.metrics.on_output(out, now)
                        self._deliver(out.request_id, _snapshot(out), out.finished)
                self._update_gauges()
        except BaseException as error:  # noqa: BLE001 - every waiter must hear of it
            logger.exception("the engine-core loop failed")
            self.dead_error = error
            self._fail_all(error)
            return
        # Shut down: abort what is left so every block is free.
        with self._lock:
            streams = list(self._streams)
        for request_id in streams:
            self.engine.abort_request(request_id)
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._update_gauges()
        self.dead_error = self.dead_error or EngineDeadError("the engine was shut down")

    def _handle_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload, future = command
            # A caller cancelled while its request waited here (a client that hung up) has
            # its future cancelled, and an abort follows: nothing to add, nobody to answer.
            if kind == "add" and future.set_running_or_notify_cancel():
                try:
                    self.engine.add_processed_request(payload)
                    self.metrics.on_arrival(payload.request_id, time.monotonic(),
                                            self.engine.engine_index_of(payload.request_id))
                    future.set_result(None)
                except Exception as error:  # a bad request: the caller gets the message
                    future.set_exception(error)
            elif kind == "abort":
                self._abort(payload)
            elif kind == "reset_prefix_cache" and future.set_running_or_notify_cancel():
                future.set_result(self.engine.reset_prefix_cache())
            elif kind == "abort_all":
                with self._lock:
                    request_ids = list(self._streams)
                for request_id in request_ids:
                    final = self.engine.abort_with_output(request_id)
                    if final is not None:
                        self.metrics.on_abort(request_id)
                        self._deliver(request_id, _snapshot(final), True)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._update_gauges()
                return

    def _deliver(self, request_id: str, item, finished: bool) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # that event loop is closed: nobody listens any more
                pass
        elif not finished:  # its listener left before the abort arrived
            self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        if self.engine.abort_request(request_id):
            self.metrics.on_abort(request_id)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.items())
        for _, (loop, outputs) in streams:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, error)
            except RuntimeError:
                pass

    def _update_gauges(self) -> None:
        """The gauges from the core's last stats (``core/stats.py``), after a step or a
        command (an abort frees blocks between steps)."""
        if isinstance(self.metrics, PerEngineMetrics):   # each data-parallel core its own
            for index, (metrics, stats) in enumerate(zip(self.metrics.engines, self.engine.stats_per_engine())):
                metrics.set_gauges(stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage,
                                   *self.engine.prefix_cache_by_engine.get(index, (0, 0)))
            return
        stats = self.engine.get_stats()
        self.metrics.set_gauges(stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage,
                                self.engine.prefix_cache_queries, self.engine.prefix_cache_hits)
        if stats.spec_decoding is not None:
            self.metrics.set_spec_decoding(stats.spec_decoding)


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the engine will not change later (its lists keep growing step by step)."""
    completions = [dataclasses.replace(c, token_ids=list(c.token_ids),
                                       logprobs=list(c.logprobs) if c.logprobs is not None else None,
                                       delta_token_ids=list(c.delta_token_ids))
                   for c in out.outputs]
    return dataclasses.replace(out, outputs=completions,
                               prompt_logprobs=list(out.prompt_logprobs) if out.prompt_logprobs else
                               out.prompt_logprobs)


def _delta(out: RequestOutput) -> RequestOutput:
    """``RequestOutputKind.DELTA``: each sample holds only this step's tokens, text and
    logprobs (vLLM's DELTA outputs; ``delta_text`` and ``delta_token_ids`` stay as well)."""
    completions = []
    for c in out.outputs:
        new = len(c.delta_token_ids)
        logprobs = c.logprobs[len(c.logprobs) - new:] if c.logprobs is not None else None
        completions.append(dataclasses.replace(c, text=c.delta_text, token_ids=list(c.delta_token_ids),
                                               logprobs=logprobs))
    return dataclasses.replace(out, outputs=completions)
