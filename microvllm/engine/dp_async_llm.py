"""``DPAsyncLLM``: one API server over N data-parallel engine cores, each request sent to
the least loaded (vLLM: ``DPLBAsyncMPClient`` in ``vllm/v1/engine/core_client.py``, the
"internal load balancer" of ``vllm serve --data-parallel-size N``)::

    clients ──> API server (this process)
                  tokenizer, chat template, every check that needs no model (EngineInputs)
                  DPAsyncLLM.generate ── picks the core of the lowest load score ──┐
                                                                                   │ ZMQ (dp_core_proc.py)
                ┌────────────────────┬────────────────────┬────────────────────────┘
                v                    v                    v
           engine core 0        engine core 1   ...  engine core N-1   (own process, model, KV cache)

The load score is vLLM 0.34's (``DPLBAsyncMPClient.get_core_engine_for_request``)::

    score = max(in_flight, waiting + running)                     what it runs and queues
          + waiting * 6 * max(0, kv_cache_usage - 0.5)            a queue on a full KV cache

``waiting``, ``running`` and ``kv_cache_usage`` are what the core last reported (several
times a second); ``in_flight`` is this client's own count of its requests on that core
not finished yet, exact at every moment: a burst spreads over the cores even before
any of them reports (a report cannot erase a request it has not seen yet). A waiting
queue counts extra only when the core's KV cache is over half full, where a queue
drains slowly; below that it is a burst's transient and the cores take turns. After a
pick, the chosen core's ``waiting`` grows by one until its next report, and the scan
starts one core further on, so that ties (idle cores) do not always go to core 0.

Each core's prefix cache is its own: requests that share a prompt prefix hit it only
on the core that computed it. The internal load balancer does not look at prompts;
a cache-aware router in front of N separate servers does (README: "Replicas behind a
router"). A dead core stops the whole server (vLLM's engine is dead after one core
dies too): a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import pickle
import shutil
import threading
import time
from collections.abc import AsyncIterator
from multiprocessing import get_context
from multiprocessing.process import BaseProcess

from microvllm.engine.arg_utils import EngineArgs, check_engine_options
from microvllm.engine.async_llm import (
    EngineClient,
    EngineDeadError,
    RequestFailedError,
    RequestRejectedError,
    new_tokenizer_threads,
)
from microvllm.engine.dp_core_proc import MODEL_NAME, DPEngineCoreProc
from microvllm.engine.input_processor import InputProcessor
from microvllm.engine.ipc_dirs import new_socket_dir
from microvllm.engine.metrics import _labelled
from microvllm.engine.outputs import RequestOutput
from microvllm.engine.prompts import PromptProcessor
from microvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0   # every core loads its model copy
KV_PRESSURE_WEIGHT = 6.0    # vLLM's: waiting counts up to 3 times more at a full KV cache

# Errors a core reports by name, raised here as the same kind (a 400, a 500, ...).
_ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError, "TypeError": TypeError, "RequestFailedError": RequestFailedError,
    "RequestRejectedError": RequestRejectedError, "EngineDeadError": EngineDeadError}


class EngineInputs:
    """What the API server asks of an engine before a request reaches a core — the config,
    the tokenizer, the checks that need no model — with no model loaded: an
    ``InputProcessor`` without a core."""

    def __init__(self, config):
        self.config = config
        self.prompts = PromptProcessor.from_model_folder(config.model_config.model_path,
                                                         vocab_size=config.model_config.hf_config.vocab_size)
        self.input_processor = InputProcessor(config, self.prompts)

    def tokenize_prompt(self, prompt, params: SamplingParams, *, name: str | None = None):
        return self.input_processor.tokenize_prompt(prompt, params, name=name)

    def check_text_fits(self, num_chars: int, which: str, shorten: str = "it") -> None:
        self.input_processor.check_text_fits(num_chars, which, shorten)

    def get_tokenizer(self):
        return self.prompts.tokenizer


@dataclasses.dataclass
class CoreState:
    """The client's view of one core."""

    index: int
    process: BaseProcess
    in_flight: int = 0         # this client's requests on it, not finished yet
    waiting: int = 0           # its last report (+ the requests sent since)
    running: int = 0
    kv_cache_usage: float = 0.0
    metrics_text: str = ""
    last_report: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def score(self) -> float:
        """vLLM 0.34's load score (the module docstring), for one API server."""
        score = float(max(self.in_flight, self.waiting + self.running))
        if self.waiting:
            score += self.waiting * KV_PRESSURE_WEIGHT * max(0.0, self.kv_cache_usage - 0.5)
        return score


def least_loaded_core(cores: list[CoreState], start: int = 0) -> CoreState:
    """The core a new request goes to: the lowest score, scanning from core ``start`` (the
    first of equal scores wins: the caller rotates ``start``)."""
    return min(cores[start:] + cores[:start], key=lambda core: core.score)


class DPAsyncLLM(EngineClient):
    """``AsyncLLM``'s interface (what the API server calls) over ``data_parallel_size``
    engine cores in processes of their own.

        llm = DPAsyncLLM(model=None, data_parallel_size=2)
        async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-1"): ...
        llm.shutdown()
    """

    def __init__(self, model: str | None = None, **kwargs):
        import zmq

        check_engine_options(kwargs)
        self.engine_args = EngineArgs(model=model, **kwargs)
        size = self.engine_args.data_parallel_size
        self.engine = EngineInputs(dataclasses.replace(self.engine_args, data_parallel_rank=0).create_engine_config())
        events = self.engine.config.kv_events_config
        if events is not None and events.enable_kv_cache_events and events.endpoint.startswith("ipc://"):
            raise ValueError(f"kv_events_config endpoint {events.endpoint!r}: with data_parallel_size={size} "
                             "every core would bind that one path; use tcp://127.0.0.1:PORT (core r publishes "
                             "on PORT + r, as vLLM's do; tcp://*:PORT for a router on another host)")
        if events is not None and events.enable_kv_cache_events:
            check_event_ports(events.endpoint, events.replay_endpoint, size)
        self.metrics = _DPMetrics(self)
        self.dead_error: BaseException | None = None
        self._stopping = threading.Event()
        self._ids = itertools.count()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, CoreState]] = {}
        self._lock = threading.Lock()   # _streams, the cores' counts and the input socket
        self.tokenizer_threads = new_tokenizer_threads()   # tokenizing here: no core needed
        # The cores connect to us: ROUTER (a message to core i is addressed "core-i"), PULL.
        # The folder's name holds our pid: removed at shutdown, or (after kill -9, when
        # nothing of ours can run) by the next server that finds that pid dead.
        self._socket_dir = new_socket_dir()
        input_address = f"ipc://{self._socket_dir}/input"
        output_address = f"ipc://{self._socket_dir}/output"
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.ROUTER)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a message to a core not connected raises
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        core_kwargs = dataclasses.asdict(self.engine_args)
        model_arg = core_kwargs.pop("model")
        threads = max(1, (os.cpu_count() or 1) // size)
        context = get_context("spawn")
        self.cores: list[CoreState] = []
        self._scan_start = 0   # rotated at each pick: ties do not always go to core 0
        for index in range(size):
            # Not a daemon: a core may start processes of its own (tensor-parallel workers,
            # grammar compilers). It exits when this process does (_exit_when_orphaned).
            process = context.Process(
                target=DPEngineCoreProc.run_engine_core, name=f"microvllm-dp-core{index}",
                args=(index, {"model": model_arg, **core_kwargs, "data_parallel_rank": index},
                      input_address, output_address,
                      threads, os.getpid()))
            process.start()
            self.cores.append(CoreState(index, process))
        try:
            self._wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        self.last_heartbeat = time.monotonic()
        self._reader = threading.Thread(target=self._read_outputs, name="microvllm-dp-outputs", daemon=True)
        self._reader.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "DPAsyncLLM":
        return cls(**dataclasses.asdict(engine_args))

    # ------------------------------------------------------------ the API
    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self._stopping.is_set()

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """As ``AsyncLLM.generate``: the request runs on the least loaded core."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running (it was shut down or failed)")
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        outputs: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id={request_id!r} is already in use: give each request a unique id")
            core = least_loaded_core(self.cores, self._scan_start)
            self._scan_start = (self._scan_start + 1) % len(self.cores)
            self._streams[request_id] = (asyncio.get_running_loop(), outputs, core)
            core.in_flight += 1
            core.waiting += 1   # until its next report counts it
            self._send(core, ("generate", request_id, prompt, sampling_params))
        finished = False
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out   # as the core's AsyncLLM.generate yielded it (per output_kind)
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
                core.in_flight -= 1
                if not finished and self.is_running:   # cancelled or closed early: the core frees its blocks
                    self._send(core, ("abort", request_id))

    async def abort(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None:
                self._send(stream[2], ("abort", request_id))

    def abort_all(self) -> None:
        """Every core aborts what it runs; each stream gets its last output."""
        with self._lock:
            for core in self.cores:
                self._send(core, ("abort_all",))

    async def reset_prefix_cache(self) -> bool:
        """Ask every core to forget its cached block hashes (each does when it reads the
        message: the answer says it was asked, not that it is done)."""
        with self._lock:
            for core in self.cores:
                self._send(core, ("reset_prefix_cache",))
        return True

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop every core (each aborts what is left first), then the sockets. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        with self._lock:
            for core in self.cores:
                self._send(core, ("shutdown",))
        deadline = time.monotonic() + timeout
        for core in self.cores:
            core.process.join(max(0.1, deadline - time.monotonic()))
            if core.process.is_alive():
                logger.warning("engine core %d did not stop within %.0f s: killing it", core.index, timeout)
                core.process.kill()
                core.process.join(5)
        self._fail_all(EngineDeadError("the engine was shut down"))
        self.dead_error = self.dead_error or EngineDeadError("the engine was shut down")
        self.tokenizer_threads.shutdown(wait=False, cancel_futures=True)
        self._context.destroy(linger=0)
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    # ------------------------------------------------------------ the cores
    def _send(self, core: CoreState, message: tuple) -> None:
        """Send under ``self._lock`` (a ZMQ socket is not thread-safe)."""
        try:
            self._input.send_multipart([f"core-{core.index}".encode(), pickle.dumps(message)])
        except Exception as error:  # noqa: BLE001 - a core gone: the reader thread reports it
            logger.debug("could not reach engine core %d: %r", core.index, error)

    def _wait_until_ready(self) -> None:
        import zmq
        ready: set[int] = set()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < len(self.cores):
            for core in self.cores:
                if not core.process.is_alive():
                    raise RuntimeError(f"engine core {core.index} exited with code {core.process.exitcode} "
                                       "while starting: its error is printed above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine cores {sorted(set(range(len(self.cores))) - ready)} did not start "
                                   f"within {STARTUP_TIMEOUT_S:.0f} s")
            if not self._output.poll(500, zmq.POLLIN):
                continue
            message = pickle.loads(self._output.recv())
            if message[0] == "ready":
                ready.add(message[1])
                logger.info("engine core %d is ready (%d KV blocks)", message[1], message[2])
            elif message[0] == "dead":
                raise RuntimeError(f"engine core {message[1]} failed: {message[2]}")

    def _read_outputs(self) -> None:
        """The output thread: hand each output to its stream; notice a core's death."""
        import zmq
        while not self._stopping.is_set():
            try:
                has_message = self._output.poll(250, zmq.POLLIN)
                message = pickle.loads(self._output.recv()) if has_message else None
            except zmq.ZMQError:   # the context was destroyed: shut down
                return
            if message is not None:
                self._handle(message)
            dead = [c for c in self.cores if not c.process.is_alive()]
            if dead and not self._stopping.is_set():
                self._die(EngineDeadError(f"engine core {dead[0].index} (pid {dead[0].process.pid}) exited "
                                          f"with code {dead[0].process.exitcode}"))
                return
            self.last_heartbeat = min(c.last_report for c in self.cores)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "stats":
            _, index, waiting, running, kv_cache_usage, text = message
            core = self.cores[index]
            with self._lock:
                core.waiting, core.running, core.kv_cache_usage = waiting, running, kv_cache_usage
                core.metrics_text = text if text is not None else core.metrics_text
                core.last_report = time.monotonic()
        elif kind == "output":
            self._deliver(message[1], message[2])
        elif kind == "error":
            _, request_id, name, text = message
            self._deliver(request_id, _ERRORS.get(name, RequestFailedError)(text))
        elif kind == "dead":
            self._die(EngineDeadError(f"engine core {message[1]} died: {message[2]}"))

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs, _ = stream
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:   # that event loop is closed: nobody listens any more
                pass

    def _die(self, error: BaseException) -> None:
        logger.error("%s: the server stops", error)
        self.dead_error = error
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for loop, outputs, _ in streams:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, error)
            except RuntimeError:
                pass


def _tcp_port(endpoint: str | None) -> int | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    try:
        return int(endpoint.rpartition(":")[2])
    except ValueError:
        return None


def check_event_ports(endpoint: str, replay_endpoint: str | None, size: int) -> None:
    """Core r publishes on the endpoint's port + r and serves replay on the replay
    endpoint's port + r: the two ranges must not overlap (5557 and 5558 with two cores:
    core 1's events would take core 0's replay port)."""
    pub, replay = _tcp_port(endpoint), _tcp_port(replay_endpoint)
    if pub is None or replay is None:
        return
    if set(range(pub, pub + size)) & set(range(replay, replay + size)):
        raise ValueError(
            f"kv_events_config: with data_parallel_size={size} core r publishes on port {pub} + r and "
            f"answers replay on port {replay} + r, and these overlap: give the replay_endpoint a port of at "
            f"least {pub + size} (e.g. tcp://127.0.0.1:{pub + size})")


class _DPMetrics:
    """``/metrics`` over the cores: each core's samples with an ``engine`` label (vLLM's),
    under one HELP and TYPE per metric."""

    def __init__(self, client: DPAsyncLLM):
        self.client = client

    def render(self, model_name: str) -> str:
        families: dict[str, list[str]] = {}   # metric name -> its HELP, TYPE, then every core's samples
        with self.client._lock:
            texts = [(core.index, core.metrics_text) for core in self.client.cores]
        for index, text in texts:
            text = text.replace(f'model_name="{MODEL_NAME}"', f'model_name="{model_name}"')
            name = ""
            for line in text.splitlines():
                if line.startswith("# HELP ") or line.startswith("# TYPE "):
                    name = line.split()[2]
                    lines = families.setdefault(name, [])
                    if index == texts[0][0]:
                        lines.append(line)
                elif line:
                    families.setdefault(name, []).append(_labelled(line, f'engine="{index}"'))
        return "".join(line + "\n" for lines in families.values() for line in lines)
