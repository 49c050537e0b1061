"""Clients of the engine core (vLLM: ``vllm/v1/engine/core_client.py``): what the front
end (``LLMEngine``, ``AsyncLLM``) calls to reach an ``EngineCore`` (``engine/core.py``).

    InprocClient      the core in this process: each get_output() runs one step (the
                      default for ``LLM``: a notebook cell can step it and look inside)
    SyncMPClient      the core in a process of its own (``EngineCoreProc``), stepping by
                      itself; get_output() waits for its next step (``LLM`` with
                      VLLM_ENABLE_V1_MULTIPROCESSING=1, ``AsyncLLM`` in ``serve``)
    DPLBMPClient      N data-parallel cores, each in a process of its own; each request
                      goes to the least loaded (``serve --data-parallel-size N``)

The two multiprocess clients share ``MPClient``: one ROUTER socket to send to the cores
(a message is addressed to one core by its identity) and one PULL socket their outputs
all arrive on, as vLLM's do::

    front end ── ROUTER ─ ["core-0", ADD, request] ──> DEALER  engine core 0 (EngineCoreProc)
                        ─ ["core-1", ADD, request] ──> DEALER  engine core 1
              <─ PULL ─── [OUTPUTS, EngineCoreOutputs(engine_index=r)] ─── PUSH  (every core)

(vLLM drives these from asyncio in ``AsyncLLM``: ``AsyncMPClient``, ``DPLBAsyncMPClient``.
Here ``AsyncLLM``'s engine thread blocks on ``get_output`` for at most a few
milliseconds at a time; the load balancing is the same.)

What the client must stop when it goes (the core processes, the sockets, their folder) is
held apart from it, in ``BackgroundResources``, as in vLLM: a finalizer calls it when the
client is garbage collected or the interpreter exits, so a script that never calls
``shutdown()`` still ends within seconds rather than waiting on a core nobody stopped.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import queue
import shutil
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from multiprocessing import get_context
from multiprocessing.process import BaseProcess

import zmq

from microvllm import envs
from microvllm.core.outputs import EngineCoreOutput
from microvllm.core.stats import SchedulerStats
from microvllm.engine.core import EngineCore, EngineCoreOutputs, EngineCoreRequest
from microvllm.engine.core_proc import (
    ABORT,
    ADD,
    DEAD,
    KIND_NAMES,
    OUTPUTS,
    READY,
    SHUTDOWN,
    STATS,
    UTILITY,
    UTILITY_OUTPUT,
    EngineCoreProc,
)
from microvllm.engine.ipc_dirs import new_socket_dir
from microvllm.engine.serial_utils import MsgpackDecoder, MsgpackEncoder, field_of

logger = logging.getLogger(__name__)

KV_PRESSURE_WEIGHT = 6.0    # vLLM's: a waiting request counts up to 3 times more at a full KV cache


class InprocClient:
    """The engine core in the caller's process, stepped by the caller (vLLM's
    ``InprocClient``). ``engine_core`` is the core itself: a learner may read its
    scheduler and KV cache between steps."""

    dead_error = None   # a step's exception reaches the caller itself

    def __init__(self, *args, **kwargs):
        self.engine_core = EngineCore(*args, **kwargs)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """Run one step of the core; what it produced (None: a step was only sent off, with
        async scheduling; ``timeout``: unused, a step here is never waited for)."""
        return self.engine_core.step_fn()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: Iterable[str], *, stop_string: bool = False) -> None:
        self.engine_core.abort_requests(request_ids, stop_string=stop_string)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    # The checks only the core can make (InputProcessor asks before adding a request).
    def check_fits(self, name: str, token_ids: list[int]) -> None:
        self.engine_core.check_fits(name, token_ids)

    def check_kv_transfer_params(self, kv_transfer_params: dict | None, token_ids: list[int]) -> None:
        self.engine_core.check_kv_transfer_params(kv_transfer_params, token_ids)

    def request_refused(self, kv_transfer_params: dict | None, token_ids: list[int] | None) -> None:
        self.engine_core.request_refused(kv_transfer_params, token_ids)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.engine_core.reset_prefix_cache(reset_running_requests)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class EngineDeadError(RuntimeError):
    """The engine core failed, exited or was shut down: no request can run any more."""


@dataclass
class CoreEngine:
    """The client's view of one engine core process (vLLM: ``CoreEngine``)."""

    index: int
    process: BaseProcess
    in_flight: int = 0         # this client's requests on it, not finished yet (exact)
    waiting: int = 0           # its last report (+ the requests sent since)
    running: int = 0
    kv_cache_usage: float = 0.0
    latest_stats: SchedulerStats | None = None

    @property
    def identity(self) -> bytes:
        """Its address on the client's ROUTER socket (its DEALER's identity)."""
        return f"core-{self.index}".encode()

    @property
    def score(self) -> float:
        """vLLM 0.34's load score (``DPLBMPClient``), for one front end."""
        score = float(max(self.in_flight, self.waiting + self.running))
        if self.waiting:
            score += self.waiting * KV_PRESSURE_WEIGHT * max(0.0, self.kv_cache_usage - 0.5)
        return score

    def report(self, stats: SchedulerStats) -> None:
        """What the core said of itself (after a step, or after an abort)."""
        self.latest_stats = stats
        self.waiting, self.running = stats.num_waiting_reqs, stats.num_running_reqs
        self.kv_cache_usage = stats.kv_cache_usage


def least_loaded_core(cores: list[CoreEngine], start: int = 0) -> CoreEngine:
    """The core a new request goes to: the lowest score, scanning from core ``start`` (the
    first of equal scores wins: the caller rotates ``start``)."""
    return min(cores[start:] + cores[:start], key=lambda core: core.score)


@dataclass
class BackgroundResources:
    """What an ``MPClient`` must stop when it goes (vLLM's ``BackgroundResources``): held
    apart from the client so that a finalizer can reach it without keeping the client
    alive. Called once: by ``shutdown()``, when the client is garbage collected, or at the
    interpreter's exit (``weakref.finalize``, and ``atexit``, see ``MPClient.__init__``)::

        stopping.set()                   the reader thread ends; a core's exit is no failure now
        SHUTDOWN to each core            it leaves its busy loop and exits 0 (its workers with it)
        join, up to the timeout          then kill what is left
        context.destroy(), rmtree        the sockets and their folder
    """

    context: zmq.Context
    input_socket: zmq.Socket
    socket_dir: str
    send_lock: threading.Lock = field(default_factory=threading.Lock)   # a ZMQ socket is not thread-safe
    stopping: threading.Event = field(default_factory=threading.Event)
    cores: list[CoreEngine] = field(default_factory=list)
    reader: threading.Thread | None = None

    EXIT_TIMEOUT_S = 5.0   # at exit or collection, as vLLM's shutdown() allows its processes

    def __call__(self, timeout: float = EXIT_TIMEOUT_S) -> None:
        self.stopping.set()
        for core in self.cores:   # one core dead: the others are stopped all the same
            if core.process.is_alive():
                try:
                    with self.send_lock:
                        self.input_socket.send_multipart([core.identity, SHUTDOWN, MsgpackEncoder().encode(None)])
                except zmq.ZMQError:   # it is going anyway (killed below if not)
                    pass
        deadline = time.monotonic() + timeout
        for core in self.cores:
            core.process.join(max(0.1, deadline - time.monotonic()))
            if core.process.is_alive():
                core.process.kill()
                core.process.join(5)
        if self.reader is not None and self.reader is not threading.current_thread():
            self.reader.join(1.0)   # it sees ``stopping`` within a poll (250 ms): its socket is then free
        self.context.destroy(linger=0)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


class MPClient:
    """``num_engines`` engine cores, each in a process of its own (``EngineCoreProc``,
    ``engine/core_proc.py``), stepping by themselves. ``get_output()`` takes the next
    step's outputs (of whichever core) from a queue a reader thread fills. The reader also
    watches the processes: a core that dies fails every caller within a second
    (``EngineDeadError``), and the client with it (vLLM's engine is dead after one core
    dies too; a supervisor restarts the server). A message from a core that cannot be
    decoded fails what it names (its requests, its utility call) and is logged; the reader
    goes on. A utility call waits ``VLLM_RPC_TIMEOUT`` at most (``envs.rpc_timeout_s``)."""

    STARTUP_TIMEOUT_S = 600.0   # loading the model

    def __init__(self, config, *, num_engines: int = 1, startup_timeout: float | None = None, **core_kwargs):
        # The folder's name holds our pid: removed at shutdown, or (after kill -9, when
        # nothing of ours can run) by the next client that finds that pid dead.
        socket_dir = new_socket_dir()
        self.input_address, self.output_address = f"ipc://{socket_dir}/input", f"ipc://{socket_dir}/output"
        context = zmq.Context()
        self._input = context.socket(zmq.ROUTER)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a message to a core gone raises
        self._input.setsockopt(zmq.SNDTIMEO, 1000)        # ... or, its queue full, waits 1 s at most
        self._input.bind(self.input_address)
        self._output = context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(self.output_address)
        self.resources = BackgroundResources(context, self._input, socket_dir)
        # Not a method of self: a finalizer that held self would keep it alive forever.
        self._finalizer = weakref.finalize(self, self.resources)
        # At exit, multiprocessing's own handler joins every child that is not a daemon (a
        # core is not: it may start workers of its own), and a core nobody stopped never
        # exits: the script would hang. atexit runs the last handler registered first, and
        # multiprocessing registered its handler when it was imported, before this line;
        # weakref.finalize's exit hook may be older still (the first finalizer made in this
        # process registers it), so the finalizer is registered here itself.
        atexit.register(self._finalizer)
        self._send_lock = self.resources.send_lock
        self._stopping = self.resources.stopping
        self._encoder = MsgpackEncoder()
        self._outputs_decoder = MsgpackDecoder(EngineCoreOutputs)
        self._decoder = MsgpackDecoder()
        self._outputs: queue.Queue = queue.Queue()
        self._calls: dict[int, queue.Queue] = {}
        self._call_ids = itertools.count()
        self.dead_error: EngineDeadError | None = None
        # The cores share this machine's CPU cores: each gets its share of torch's threads.
        num_threads = max(1, (os.cpu_count() or 1) // num_engines) if num_engines > 1 else None
        self.cores: list[CoreEngine] = self.resources.cores
        try:
            for index in range(num_engines):
                rank_config = config
                if num_engines > 1:   # each core its rank (its KV event ports are offset by it)
                    rank_config = replace(config, parallel_config=replace(config.parallel_config,
                                                                          data_parallel_rank=index))
                # Not a daemon: a core may start processes of its own (tensor-parallel workers).
                # It stops when told (BackgroundResources), or when this process is gone
                # (_exit_when_orphaned: after a kill -9, when nothing of ours can run).
                process = get_context("spawn").Process(
                    target=EngineCoreProc.run_engine_core,
                    name="microvllm-engine-core" if num_engines == 1 else f"microvllm-engine-core{index}",
                    args=(rank_config, core_kwargs, self.input_address, self.output_address, os.getpid(), index,
                          num_threads))
                process.start()
                self.cores.append(CoreEngine(index, process))
            ready = self._wait_until_ready(startup_timeout or self.STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self.num_kv_blocks: int = ready["num_kv_blocks"]
        self.max_prompt_tokens: int = ready["max_prompt_tokens"]
        # It holds the client only while it reads one message (_read_outputs_of).
        self.resources.reader = threading.Thread(target=_read_outputs_of, args=(weakref.ref(self),),
                                                 name="microvllm-core-client", daemon=True)
        self.resources.reader.start()

    def _wait_until_ready(self, timeout: float) -> dict:
        """The handshake: each core's DEALER says hello on the input socket (the ROUTER can
        address it from then on), and READY once its model and KV cache are up."""
        deadline = time.monotonic() + timeout
        ready: dict[int, dict] = {}
        hello: set[bytes] = set()
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._input, zmq.POLLIN)
        while len(ready) < len(self.cores) or len(hello) < len(self.cores):
            events = dict(poller.poll(200))
            if self._input in events:
                hello.add(self._input.recv_multipart()[0])
            if self._output in events:
                kind, payload = self._output.recv_multipart()
                if kind == READY:
                    answer = self._decoder.decode(payload)
                    ready[answer["engine_index"]] = answer
                elif kind == DEAD:   # a bad setting is a ValueError here as it would be in-process
                    raise _error_of(*self._decoder.decode(payload)[:2])
            for core in self.cores:
                if core.index not in ready and not core.process.is_alive():
                    raise RuntimeError(f"the engine core process{self._which(core)} exited with code "
                                       f"{core.process.exitcode} while starting: its error is printed above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core did not start within {timeout:.0f} s")
        return ready[0]

    def _which(self, core: CoreEngine) -> str:
        return f" {core.index}" if len(self.cores) > 1 else ""

    def _read_output(self) -> bool:
        """One pass of the reader thread (``_read_outputs_of``): each output to the queue,
        each utility result to its caller, a dead core to everyone. False: stop reading."""
        if self._stopping.is_set():
            return False
        try:
            if not self._output.poll(250, zmq.POLLIN):
                for core in self.cores:
                    if not core.process.is_alive() and not self._stopping.is_set():   # (stopped: no failure)
                        self._die(f"the engine core process{self._which(core)} (pid {core.process.pid}) "
                                  f"exited with code {core.process.exitcode}")
                        return False
                return True
            frames = self._output.recv_multipart()
        except zmq.ZMQError:   # the context was destroyed: shut down
            return False
        kind = frames[0] if frames else b""
        try:
            if len(frames) != 2:
                raise ValueError(f"expected 2 frames, [kind, payload]; got {len(frames)}")
            return self._handle_output(kind, frames[1])
        except Exception as error:  # noqa: BLE001 - one bad message must not end the thread (and every request)
            return self._refuse_output(kind, frames, error)

    def _handle_output(self, kind: bytes, payload: bytes) -> bool:
        if kind == OUTPUTS or kind == STATS:
            outputs = self._outputs_decoder.decode(payload)
            core = self.cores[outputs.engine_index]   # an index out of range: refused as undecodable
            if outputs.scheduler_stats is not None:
                core.report(outputs.scheduler_stats)
            if kind == OUTPUTS:
                self._outputs.put(outputs)
        elif kind == UTILITY_OUTPUT:
            call_id, result, error = self._decoder.decode(payload)
            answer = self._calls.pop(call_id, None)
            if answer is not None:
                answer.put((result, error))
        elif kind == DEAD:
            error_type, message, index = self._decoder.decode(payload)
            self._die(f"the engine core{self._which(self.cores[index])} failed: {error_type}: {message}")
            return False
        else:
            raise ValueError(f"unknown kind {kind[:8]!r}")
        return True

    def _refuse_output(self, kind: bytes, frames: list[bytes], error: Exception) -> bool:
        """A message from a core that does not decode: logged, loudly, and what it names
        fails (its requests, aborted in their core; its utility call); the reader goes on.
        False: it was a core's DEAD, which is read as the core's death all the same."""
        size = sum(len(frame) for frame in frames)
        logger.error("dropped a message from the engine core that could not be decoded (kind %s, %d frames, "
                     "%d bytes): %s: %s", KIND_NAMES.get(kind, repr(kind[:8])), len(frames), size,
                     type(error).__name__, str(error)[:300])
        payload = frames[-1] if len(frames) >= 2 else b""
        why = f"the engine core's message for it could not be decoded ({type(error).__name__}: {str(error)[:200]})"
        if kind == DEAD:
            self._die(f"the engine core failed (its last message could not be decoded: {str(error)[:300]})")
            return False
        if kind == OUTPUTS:
            outputs = field_of(payload, "outputs")
            request_ids = [o["request_id"] for o in outputs if isinstance(o, dict)
                           and isinstance(o.get("request_id"), str)] if isinstance(outputs, list) else []
            index = field_of(payload, "engine_index")
            core = self.cores[index] if isinstance(index, int) and 0 <= index < len(self.cores) else self.cores[0]
            if request_ids:   # each fails; its core, which still runs it, is told to stop it
                self._outputs.put(EngineCoreOutputs(
                    [EngineCoreOutput(r, (), finish_reason="error", error=why) for r in request_ids],
                    timestamp=time.monotonic(), engine_index=core.index))
                try:
                    self._send(core, ABORT, (request_ids, False))
                except EngineDeadError:
                    pass
        elif kind == UTILITY_OUTPUT:
            answer = self._calls.pop(call_id, None) if isinstance(call_id := field_of(payload, 0), int) else None
            if answer is not None:
                answer.put((None, ("RuntimeError", why)))
        return True

    def _die(self, message: str) -> None:
        self.dead_error = EngineDeadError(message)
        self._outputs.put(self.dead_error)
        for answer in list(self._calls.values()):
            answer.put((None, ("EngineDeadError", message)))

    def _send(self, core: CoreEngine, kind: bytes, payload) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        try:
            with self._send_lock:
                self._input.send_multipart([core.identity, kind, self._encoder.encode(payload)])
        except zmq.ZMQError:   # EHOSTUNREACH (gone) or EAGAIN (not reading)
            raise self.dead_error or EngineDeadError(
                f"the engine core{self._which(core)} takes no input: its process is gone") from None

    def call_utility(self, method: str, *args, core: int = 0, timeout: float | None = None):
        """Run ``EngineCore.<method>(*args)`` in core ``core``'s process, between two of its
        steps; its result, or its exception raised here (as the same kind where it is a
        ``ValueError`` or a ``TypeError``). ``timeout``: seconds to wait for the answer
        (default ``VLLM_RPC_TIMEOUT``); none by then: ``TimeoutError``."""
        timeout = envs.rpc_timeout_s() if timeout is None else timeout
        call_id = next(self._call_ids)
        answer: queue.Queue = queue.Queue()
        self._calls[call_id] = answer
        try:
            self._send(self.cores[core], UTILITY, (call_id, method, list(args)))
            result, error = answer.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"the engine core{self._which(self.cores[core])} did not answer the utility call {method}() "
                f"within {timeout:g} s: it may be stuck in a step; if its steps are that long, raise "
                f"VLLM_RPC_TIMEOUT (milliseconds)") from None
        finally:
            self._calls.pop(call_id, None)   # an answer after the deadline is dropped
        if error is not None:
            raise _error_of(*error)
        return result

    # ------------------------------------------------------------ the API
    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """The next step's outputs, of any core (blocks until one sends them, or ``timeout``
        seconds: then None)."""
        if self.dead_error is not None:
            raise self.dead_error
        try:
            outputs = self._outputs.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(outputs, BaseException):
            raise outputs
        self._finished(outputs)
        return outputs

    def _finished(self, outputs: EngineCoreOutputs) -> None:
        """The requests that ended in these outputs (a subclass counts them)."""

    def add_request(self, request: EngineCoreRequest) -> None:
        # A compiled grammar is no plain data: the core compiles its own from the params.
        self._send(self.core_for(request), ADD,
                   replace(request, grammar=None) if request.grammar is not None else request)

    def core_for(self, request: EngineCoreRequest) -> CoreEngine:
        """The core that runs ``request``."""
        return self.cores[0]

    def abort_requests(self, request_ids: Iterable[str], *, stop_string: bool = False) -> None:
        self._send(self.cores[0], ABORT, (list(request_ids), stop_string))

    def has_unfinished_requests(self) -> bool:
        """False: the cores step by themselves; the front end knows what it still waits for."""
        return False

    @property
    def latest_stats(self) -> SchedulerStats | None:
        """The core's state as its last message said (gauges: read when no step follows)."""
        return self.cores[0].latest_stats

    def check_fits(self, name: str, token_ids: list[int]) -> None:
        if len(token_ids) > self.max_prompt_tokens:   # the core words the error
            self.call_utility("check_fits", name, token_ids)

    def check_kv_transfer_params(self, kv_transfer_params: dict | None, token_ids: list[int]) -> None:
        self.call_utility("check_kv_transfer_params", kv_transfer_params, token_ids)

    def request_refused(self, kv_transfer_params: dict | None, token_ids: list[int] | None) -> None:
        self.call_utility("request_refused", kv_transfer_params, token_ids)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Every core forgets its cached block hashes; False if any had blocks in use."""
        return all([self.call_utility("reset_prefix_cache", reset_running_requests, core=core.index)
                    for core in self.cores])

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core processes (each stops its own workers), then the sockets
        (``BackgroundResources``). Idempotent."""
        if self._finalizer.detach() is not None:   # not run yet, and now never by the finalizer
            atexit.unregister(self._finalizer)
            self.resources(timeout)


def _read_outputs_of(client_ref: weakref.ref) -> None:
    """The reader thread. It holds the client only while it reads one message: a client
    nobody uses any more is then garbage collected, and its finalizer stops its cores."""
    while True:
        client = client_ref()
        if client is None or not client._read_output():
            return
        del client


class SyncMPClient(MPClient):
    """One engine core in a process of its own, for a caller that blocks on each step's
    outputs (vLLM's ``SyncMPClient``: ``LLM``'s client when
    ``VLLM_ENABLE_V1_MULTIPROCESSING=1``)."""

    def __init__(self, config, *, startup_timeout: float | None = None, **core_kwargs):
        super().__init__(config, num_engines=1, startup_timeout=startup_timeout, **core_kwargs)

    @property
    def process(self) -> BaseProcess:
        """The core's process."""
        return self.cores[0].process


class DPLBMPClient(MPClient):
    """``data_parallel_size`` engine cores (each a whole model copy and KV cache) behind one
    front end, each request sent to the least loaded (vLLM: ``DPLBAsyncMPClient``, the
    "internal load balancer" of ``vllm serve --data-parallel-size N``).

    The load score is vLLM 0.34's (``get_core_engine_for_request``)::

        score = max(in_flight, waiting + running)               what it runs and queues
              + waiting * 6 * max(0, kv_cache_usage - 0.5)      a queue on a full KV cache

    ``waiting``, ``running`` and ``kv_cache_usage`` are what the core last reported (after
    each step); ``in_flight`` is this client's own count of its requests on that core not
    finished yet, exact at every moment: a burst spreads over the cores even before any of
    them reports (a report cannot erase a request it has not seen yet). A waiting queue
    counts extra only when the core's KV cache is over half full, where a queue drains
    slowly; below that it is a burst's transient and the cores take turns. After a pick
    the chosen core's ``waiting`` grows by one until its next report, and the scan starts
    one core further on, so that ties (idle cores) do not always go to core 0.

    Each core's prefix cache is its own: requests that share a prompt prefix hit it only
    on the core that computed it. This balancer does not look at prompts; a cache-aware
    router in front of N separate servers does (README: "Replicas behind a router").
    """

    def __init__(self, config, *, startup_timeout: float | None = None, **core_kwargs):
        check_data_parallel_events(config)
        self._request_core: dict[str, CoreEngine] = {}   # touched by the caller's thread only
        self._scan_start = 0
        super().__init__(config, num_engines=config.parallel_config.data_parallel_size,
                         startup_timeout=startup_timeout, **core_kwargs)

    def core_for(self, request: EngineCoreRequest) -> CoreEngine:
        core = least_loaded_core(self.cores, self._scan_start)
        self._scan_start = (self._scan_start + 1) % len(self.cores)
        self._request_core[request.request_id] = core
        core.in_flight += 1
        core.waiting += 1   # until its next report counts it
        return core

    def engine_index_of(self, request_id: str) -> int:
        """The core that runs ``request_id`` (0 once it finished)."""
        core = self._request_core.get(request_id)
        return core.index if core is not None else 0

    def _finished(self, outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            if out.finished:
                self._forget(out.request_id)

    def _forget(self, request_id: str) -> None:
        core = self._request_core.pop(request_id, None)
        if core is not None:
            core.in_flight -= 1

    def abort_requests(self, request_ids: Iterable[str], *, stop_string: bool = False) -> None:
        """Each to the core that runs it (an id no core runs: nothing to do)."""
        by_core: dict[int, list[str]] = {}
        for request_id in request_ids:
            core = self._request_core.get(request_id)
            if core is not None:
                by_core.setdefault(core.index, []).append(request_id)
                self._forget(request_id)
        for index, ids in by_core.items():
            self._send(self.cores[index], ABORT, (ids, stop_string))

    @property
    def latest_stats(self) -> SchedulerStats | None:
        """All the cores' last stats added up (KV usage: their mean)."""
        reports = [core.latest_stats for core in self.cores if core.latest_stats is not None]
        if not reports:
            return None
        return SchedulerStats(num_running_reqs=sum(s.num_running_reqs for s in reports),
                              num_waiting_reqs=sum(s.num_waiting_reqs for s in reports),
                              kv_cache_usage=sum(s.kv_cache_usage for s in reports) / len(self.cores))


def check_data_parallel_events(config) -> None:
    """KV events with N cores on one machine: core r publishes on the endpoint's port + r
    and answers replay on the replay endpoint's port + r. An ``ipc://`` path cannot be
    offset (every core would bind it), and the two port ranges must not overlap (5557 and
    5558 with two cores: core 1's events would take core 0's replay port)."""
    events, size = config.kv_events_config, config.parallel_config.data_parallel_size
    if events is None or not events.enable_kv_cache_events:
        return
    if events.endpoint.startswith("ipc://"):
        raise ValueError(f"kv_events_config endpoint {events.endpoint!r}: with data_parallel_size={size} "
                         "every core would bind that one path; use tcp://127.0.0.1:PORT (core r publishes "
                         "on PORT + r, as vLLM's do; tcp://*:PORT for a router on another host)")
    pub, replay = _tcp_port(events.endpoint), _tcp_port(events.replay_endpoint)
    if pub is None or replay is None:
        return
    if set(range(pub, pub + size)) & set(range(replay, replay + size)):
        raise ValueError(
            f"kv_events_config: with data_parallel_size={size} core r publishes on port {pub} + r and "
            f"answers replay on port {replay} + r, and these overlap: give the replay_endpoint a port of at "
            f"least {pub + size} (e.g. tcp://127.0.0.1:{pub + size})")


def _tcp_port(endpoint: str | None) -> int | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    try:
        return int(endpoint.rpartition(":")[2])
    except ValueError:
        return None


def _error_of(error_type: str, message: str) -> Exception:
    """The exception a core reported by name, as the kind a caller catches (a bad request or
    setting: ``ValueError``, a server's 400); anything else a ``RuntimeError``."""
    kinds: dict[str, type[Exception]] = {"ValueError": ValueError, "PoolTooSmallError": ValueError,
                                         "TypeError": TypeError, "EngineDeadError": EngineDeadError}
    return kinds.get(error_type, RuntimeError)(message)
