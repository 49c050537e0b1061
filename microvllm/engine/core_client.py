"""Clients of the engine core (vLLM: ``vllm/v1/engine/core_client.py``): what the front
end (``LLMEngine``, ``AsyncLLM``) calls to reach an ``EngineCore`` (``engine/core.py``).

    InprocClient      the core in this process: each get_output() runs one step (the
                      default for ``LLM``: a notebook cell can step it and look inside)
    SyncMPClient      the core in a process of its own (``EngineCoreProc``), stepping by
                      itself; get_output() waits for its next step (``LLM`` with
                      VLLM_ENABLE_V1_MULTIPROCESSING=1)
    DPAsyncLLM        N data-parallel cores in processes of their own (``engine/dp_async_llm.py``;
                      its AsyncLLM-in-each-core design is what DPLBAsyncMPClient replaces)

"""

from __future__ import annotations

import itertools
import os
import queue
import shutil
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from multiprocessing import get_context

import zmq

from microvllm.core.stats import SchedulerStats
from microvllm.engine.core import EngineCore, EngineCoreOutputs, EngineCoreRequest
from microvllm.engine.core_proc import (
    ABORT,
    ADD,
    DEAD,
    OUTPUTS,
    READY,
    SHUTDOWN,
    STATS,
    UTILITY,
    UTILITY_OUTPUT,
    EngineCoreProc,
)
from microvllm.engine.ipc_dirs import new_socket_dir
from microvllm.engine.serial_utils import MsgpackDecoder, MsgpackEncoder


class InprocClient:
    """The engine core in the caller's process, stepped by the caller (vLLM's
    ``InprocClient``). ``engine_core`` is the core itself: a learner may read its
    scheduler and KV cache between steps."""

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


class SyncMPClient:
    """The engine core in a process of its own (``EngineCoreProc``, ``engine/core_proc.py``),
    for a caller that blocks on each step's outputs (vLLM's ``SyncMPClient``, ``LLM``'s
    client when ``VLLM_ENABLE_V1_MULTIPROCESSING=1``).

    The core steps on its own while it has work; ``get_output()`` takes the next step's
    outputs from a queue that a reader thread fills. The reader also watches the process:
    a core that dies fails every caller within a second (``EngineDeadError``).
    """

    STARTUP_TIMEOUT_S = 600.0   # loading the model

    def __init__(self, config, *, startup_timeout: float | None = None, **core_kwargs):
        self._socket_dir = new_socket_dir()
        input_address, output_address = f"ipc://{self._socket_dir}/input", f"ipc://{self._socket_dir}/output"
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        # A PUSH with no peer (the core gone, or not yet up) blocks a send: wait 1 s at most.
        self._input.setsockopt(zmq.SNDTIMEO, 1000)
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        self._encoder = MsgpackEncoder()
        self._outputs_decoder = MsgpackDecoder(EngineCoreOutputs)
        self._stats_decoder = MsgpackDecoder(SchedulerStats)
        # The core's state as its last message said (gauges: read when no step follows).
        self.latest_stats: SchedulerStats | None = None
        self._decoder = MsgpackDecoder()
        self._send_lock = threading.Lock()    # a ZMQ socket is not thread-safe
        self._outputs: queue.Queue = queue.Queue()
        self._calls: dict[int, queue.Queue] = {}
        self._call_ids = itertools.count()
        self.dead_error: EngineDeadError | None = None
        self._stopping = threading.Event()
        # Not a daemon: the core may start processes of its own (tensor-parallel workers).
        # It exits when this process does (_exit_when_orphaned).
        self.process = get_context("spawn").Process(
            target=EngineCoreProc.run_engine_core, name="microvllm-engine-core",
            args=(config, core_kwargs, input_address, output_address, os.getpid()))
        self.process.start()
        try:
            ready = self._wait_until_ready(startup_timeout or self.STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self.num_kv_blocks: int = ready["num_kv_blocks"]
        self.max_prompt_tokens: int = ready["max_prompt_tokens"]
        self._reader = threading.Thread(target=self._read_outputs, name="microvllm-core-client", daemon=True)
        self._reader.start()

    def _wait_until_ready(self, timeout: float) -> dict:
        """The handshake: the core says READY once its model and KV cache are up."""
        deadline = time.monotonic() + timeout
        while True:
            if self._output.poll(200, zmq.POLLIN):
                kind, payload = self._output.recv_multipart()
                if kind == READY:
                    return self._decoder.decode(payload)
                if kind == DEAD:   # a bad setting is a ValueError here as it would be in-process
                    raise _error_of(*self._decoder.decode(payload))
            elif not self.process.is_alive():
                raise RuntimeError(f"the engine core process exited with code {self.process.exitcode} while "
                                   "starting: its error is printed above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core did not start within {timeout:.0f} s")

    def _read_outputs(self) -> None:
        """The reader thread: each output to the queue, each utility result to its caller;
        a dead core to everyone."""
        while not self._stopping.is_set():
            try:
                if not self._output.poll(250, zmq.POLLIN):
                    if not self.process.is_alive():
                        self._die(f"the engine core process (pid {self.process.pid}) exited with code "
                                  f"{self.process.exitcode}")
                        return
                    continue
                kind, payload = self._output.recv_multipart()
            except zmq.ZMQError:   # the context was destroyed: shut down
                return
            if kind == OUTPUTS:
                outputs = self._outputs_decoder.decode(payload)
                self.latest_stats = outputs.scheduler_stats or self.latest_stats
                self._outputs.put(outputs)
            elif kind == STATS:
                self.latest_stats = self._stats_decoder.decode(payload)
            elif kind == UTILITY_OUTPUT:
                call_id, result, error = self._decoder.decode(payload)
                answer = self._calls.pop(call_id, None)
                if answer is not None:
                    answer.put((result, error))
            elif kind == DEAD:
                error_type, message = self._decoder.decode(payload)
                self._die(f"the engine core failed: {error_type}: {message}")
                return

    def _die(self, message: str) -> None:
        self.dead_error = EngineDeadError(message)
        self._outputs.put(self.dead_error)
        for answer in list(self._calls.values()):
            answer.put((None, ("EngineDeadError", message)))

    def _send(self, kind: bytes, payload) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        try:
            with self._send_lock:
                self._input.send_multipart([kind, self._encoder.encode(payload)])
        except zmq.Again:
            raise self.dead_error or EngineDeadError("the engine core takes no input: its process is gone") from None

    def call_utility(self, method: str, *args):
        """Run ``EngineCore.<method>(*args)`` in the core's process, between two of its
        steps; its result, or its exception raised here (as the same kind where it is a
        ``ValueError`` or a ``TypeError``)."""
        call_id = next(self._call_ids)
        answer: queue.Queue = queue.Queue()
        self._calls[call_id] = answer
        self._send(UTILITY, (call_id, method, list(args)))
        result, error = answer.get()
        if error is not None:
            raise _error_of(*error)
        return result

    # ------------------------------------------------------------ the API
    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """The next step's outputs (blocks until the core sends them, or ``timeout``
        seconds: then None)."""
        if self.dead_error is not None:
            raise self.dead_error
        try:
            outputs = self._outputs.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(outputs, BaseException):
            raise outputs
        return outputs

    def add_request(self, request: EngineCoreRequest) -> None:
        # A compiled grammar is no plain data: the core compiles its own from the params.
        self._send(ADD, replace(request, grammar=None) if request.grammar is not None else request)

    def abort_requests(self, request_ids: Iterable[str], *, stop_string: bool = False) -> None:
        self._send(ABORT, (list(request_ids), stop_string))

    def has_unfinished_requests(self) -> bool:
        """False: this core steps by itself; the front end knows what it still waits for."""
        return False

    def check_fits(self, name: str, token_ids: list[int]) -> None:
        if len(token_ids) > self.max_prompt_tokens:   # the core words the error
            self.call_utility("check_fits", name, token_ids)

    def check_kv_transfer_params(self, kv_transfer_params: dict | None, token_ids: list[int]) -> None:
        self.call_utility("check_kv_transfer_params", kv_transfer_params, token_ids)

    def request_refused(self, kv_transfer_params: dict | None, token_ids: list[int] | None) -> None:
        self.call_utility("request_refused", kv_transfer_params, token_ids)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.call_utility("reset_prefix_cache", reset_running_requests)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core process (it stops its own workers), then the sockets. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.process.is_alive() and self.dead_error is None:
            try:
                self._send(SHUTDOWN, None)
            except Exception:  # noqa: BLE001 - it is going anyway (killed below if not)
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._context.destroy(linger=0)
        shutil.rmtree(self._socket_dir, ignore_errors=True)


def _error_of(error_type: str, message: str) -> Exception:
    """The exception a core reported by name, as the kind a caller catches (a bad request or
    setting: ``ValueError``, a server's 400); anything else a ``RuntimeError``."""
    kinds: dict[str, type[Exception]] = {"ValueError": ValueError, "PoolTooSmallError": ValueError,
                                         "TypeError": TypeError, "EngineDeadError": EngineDeadError}
    return kinds.get(error_type, RuntimeError)(message)
