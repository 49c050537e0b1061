"""The engine core in a process of its own (vLLM: ``EngineCoreProc`` in
``vllm/v1/engine/core.py``).

``EngineCoreProc``: one ``EngineCore`` behind two ZMQ sockets, driven by a client in the
front end's process (``MPClient``, ``engine/core_client.py``: one core, or N
data-parallel ones, all on the client's two sockets)::

    front end (LLMEngine)                           engine core process r
    ─────────────────────                           ─────────────────────
    MPClient ── ROUTER ─ ["core-r", ADD, EngineCoreRequest] ──> DEALER ─> input thread ─> input_queue
                       ─ ["core-r", ABORT, (ids, stop_string)]        (says hello first)     │
                       ─ ["core-r", UTILITY, (call id, method, args)]                        v
                                                                 busy loop: take the input, then
                                                                 one EngineCore.step() if any
                                                                 request is unfinished
             <─ PULL ─ [OUTPUTS, EngineCoreOutputs] ──────────── PUSH <─ output thread <─ output_queue
                       [STATS, EngineCoreOutputs (stats only)]   after an abort (no step may follow)
                       [UTILITY_OUTPUT, (call id, result, error)]
                       [READY, {engine_index, num_kv_blocks, max_prompt_tokens}]   once, model loaded
                       [DEAD, (error type, message, engine_index)]   the core failed: it exits 1

Every message is msgspec (``engine/serial_utils.py``): a socket that unpickled could be
made to run anything. The threads do the (de)serializing and the socket waits, so the
busy loop spends its time stepping, as in vLLM; the loop is the only user of the core.
A message the input thread cannot decode (each kind has its declared shape) never reaches
the loop and never ends the thread: it is logged with its kind and size, and the request
or utility call it names, if any, gets an error back.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import traceback
from typing import Any

import zmq

from microvllm.core.outputs import EngineCoreOutput
from microvllm.engine.core import EngineCore, EngineCoreOutputs, EngineCoreRequest
from microvllm.engine.serial_utils import MsgpackDecoder, MsgpackEncoder, field_of
from microvllm.executor.multiproc_executor import _exit_when_orphaned
from microvllm.utils.gc_utils import freeze_gc_heap

logger = logging.getLogger(__name__)

# vLLM's EngineCoreRequestType values (the first frame of a message to the core).
ADD, ABORT, UTILITY, SHUTDOWN = b"\x00", b"\x01", b"\x03", b"\x09"
# The first frame of a message from the core.
OUTPUTS, STATS, UTILITY_OUTPUT, READY, DEAD = b"o", b"s", b"u", b"r", b"d"
# What a client may call on the core by name (UTILITY): nothing else is reachable.
UTILITY_METHODS = frozenset({"check_fits", "check_kv_transfer_params", "request_refused",
                             "reset_prefix_cache", "check_invariants"})
KIND_NAMES = {ADD: "ADD", ABORT: "ABORT", UTILITY: "UTILITY", SHUTDOWN: "SHUTDOWN", OUTPUTS: "OUTPUTS",
              STATS: "STATS", UTILITY_OUTPUT: "UTILITY_OUTPUT", READY: "READY", DEAD: "DEAD"}


class EngineCoreProc:
    """The busy loop of an engine core in its own process (vLLM: ``run_busy_loop``)."""

    def __init__(self, input_address: str, output_address: str, engine_index: int = 0):
        self.context = zmq.Context()
        self.input_address, self.output_address = input_address, output_address
        self.engine_index = engine_index
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        # What each kind of message carries: one that does not decode as its kind's shape
        # is refused by the input thread, so the busy loop never meets a malformed payload.
        self.decoders = {ADD: MsgpackDecoder(EngineCoreRequest),
                         ABORT: MsgpackDecoder(tuple[list[str], bool]),       # (request ids, stop_string)
                         UTILITY: MsgpackDecoder(tuple[int, str, list[Any]]),  # (call id, method, args)
                         SHUTDOWN: MsgpackDecoder()}
        self.encoder = MsgpackEncoder()
        threading.Thread(target=self._send_outputs, name="microvllm-core-output", daemon=True).start()

    def start_core(self, config, core_kwargs: dict) -> None:
        """Load the model and size the KV cache, then take input and say READY."""
        self.engine_core = EngineCore(config, **core_kwargs)
        freeze_gc_heap()   # the model stays for the process's life: the collector skips it
        threading.Thread(target=self._read_inputs, args=(self.input_address,), name="microvllm-core-input",
                         daemon=True).start()
        self.output_queue.put((READY, {"engine_index": self.engine_index,
                                       "num_kv_blocks": self.engine_core.num_kv_blocks,
                                       "max_prompt_tokens": self.engine_core.max_prompt_tokens()}))

    # ------------------------------------------------------------ threads
    def _read_inputs(self, address: str) -> None:
        """The input thread: decode each message and queue it for the busy loop."""
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, f"core-{self.engine_index}".encode())   # the client's address for us
        socket.connect(address)
        socket.send(b"")   # hello: the client's ROUTER knows us once this arrives
        while True:
            try:
                frames = socket.recv_multipart()
            except zmq.ContextTerminated:   # the process is exiting
                socket.close(linger=0)
                return
            message = self._decode_input(frames)
            if message is not None:
                self.input_queue.put(message)

    def _decode_input(self, frames: list[bytes]) -> tuple[bytes, Any] | None:
        """``(kind, payload)`` of a message from the client; None for one that does not
        decode, after failing what it names (``_refuse_input``)."""
        kind = frames[0] if frames else b""
        try:
            if len(frames) != 2 or kind not in self.decoders:
                raise ValueError(f"expected 2 frames, [kind, payload], with a known kind; got {len(frames)} "
                                 f"frames, kind {kind[:8]!r}")
            return kind, self.decoders[kind].decode(frames[1])
        except Exception as error:  # noqa: BLE001 - one bad message must not end the thread (and every request)
            self._refuse_input(kind, frames, error)
            return None

    def _refuse_input(self, kind: bytes, frames: list[bytes], error: Exception) -> None:
        """Log an undecodable message, loudly; fail the request or utility call it names."""
        size = sum(len(frame) for frame in frames)
        logger.error("engine core %d dropped a message it could not decode (kind %s, %d frames, %d bytes): %s: %s",
                     self.engine_index, KIND_NAMES.get(kind, repr(kind[:8])), len(frames), size,
                     type(error).__name__, str(error)[:300])
        payload = frames[-1] if len(frames) >= 2 else b""
        if kind == ADD and isinstance(request_id := field_of(payload, "request_id"), str):
            failed = EngineCoreOutput(request_id, (), finish_reason="error",
                                      error=f"the engine core could not decode this request: {str(error)[:300]}")
            self.output_queue.put((OUTPUTS, EngineCoreOutputs([failed], timestamp=time.monotonic(),
                                                              engine_index=self.engine_index)))
        elif kind == UTILITY and isinstance(call_id := field_of(payload, 0), int):
            self.output_queue.put((UTILITY_OUTPUT, (call_id, None, (
                "RuntimeError", f"the engine core could not decode this utility call: {str(error)[:300]}"))))

    def _send_outputs(self) -> None:
        """The output thread: encode each output and send it (vLLM: ``process_output_sockets``)."""
        socket = self.context.socket(zmq.PUSH)
        socket.connect(self.output_address)
        while True:
            kind, payload = self.output_queue.get()
            if kind is None:   # close(): everything before it is on its way
                socket.close(linger=2000)
                payload.set()
                return
            socket.send_multipart([kind, self.encoder.encode(payload)])

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (the socket lingers up to 2 s for it to leave), then end
        both threads: a thread left blocked on a socket would hold the process's exit."""
        sent = threading.Event()
        self.output_queue.put((None, sent))
        sent.wait(timeout)
        ended = threading.Thread(target=self.context.term, daemon=True)   # the input thread then closes
        ended.start()
        ended.join(timeout)

    # ---------------------------------------------------------- busy loop
    def run_busy_loop(self) -> None:
        """Take what arrived (waiting for it when there is nothing to run), then step."""
        while True:
            if not self._process_input_queue():
                return
            if self.engine_core.has_unfinished_requests():
                outputs = self.engine_core.step_fn()
                if outputs is not None:   # async scheduling: None when a step was only sent off
                    outputs.engine_index = self.engine_index
                    self.output_queue.put((OUTPUTS, outputs))

    def _process_input_queue(self) -> bool:
        """Handle every queued message; block for one while the core is idle. False: shut down."""
        block = not self.engine_core.has_unfinished_requests()
        while True:
            try:
                kind, payload = self.input_queue.get(block=block)
            except queue.Empty:
                return True
            if kind == SHUTDOWN:
                return False
            self._handle(kind, payload)
            block = False

    def _handle(self, kind: bytes, payload: Any) -> None:
        core = self.engine_core
        if kind == ADD:
            kv_transfer_params = None
            try:   # the checks an in-process front end asks for before adding, made here too
                core.check_fits(payload.request_id, payload.prompt_token_ids)
                kv_transfer_params = (payload.sampling_params.extra_args or {}).get("kv_transfer_params")
                core.check_kv_transfer_params(kv_transfer_params, payload.prompt_token_ids)
                core.add_request(payload)
            except ValueError as refusal:
                core.request_refused(kv_transfer_params, payload.prompt_token_ids)
                refused = EngineCoreOutput(payload.request_id, (), finish_reason="error", error=str(refusal),
                                           bad_request=True)
                self.output_queue.put((OUTPUTS, EngineCoreOutputs([refused], timestamp=time.monotonic(),
                                                                  engine_index=self.engine_index)))
        elif kind == ABORT:
            request_ids, stop_string = payload
            core.abort_requests(request_ids, stop_string=stop_string)
            # Its blocks are free now: the gauges must say so even if no step follows.
            self.output_queue.put((STATS, EngineCoreOutputs(scheduler_stats=core.make_stats(),
                                                            engine_index=self.engine_index)))
        elif kind == UTILITY:
            call_id, method, args = payload
            failed: tuple[str, str] | None = None
            try:
                if method not in UTILITY_METHODS:
                    raise AttributeError(f"the engine core has no utility method {method!r}")
                result = getattr(core, method)(*args)
            except Exception as failure:  # noqa: BLE001 - the caller raises it
                result, failed = None, (type(failure).__name__, str(failure))
            self.output_queue.put((UTILITY_OUTPUT, (call_id, result, failed)))

    @staticmethod
    def run_engine_core(config, core_kwargs: dict, input_address: str, output_address: str,
                        parent_pid: int, engine_index: int = 0, num_threads: int | None = None) -> None:
        """The process's entry point (``multiprocessing`` spawn). Exits 0 after SHUTDOWN, 1
        after sending DEAD (a failed start or step); the client sees either.
        ``num_threads``: torch's threads, when N data-parallel cores share this machine."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the front end, which decides
        if not logging.getLogger().handlers:   # a fresh interpreter (spawn): its warnings and errors to stderr
            logging.basicConfig(level=logging.WARNING,
                                format=f"%(levelname)s %(name)s (engine core {engine_index}): %(message)s")
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
        if num_threads is not None:
            import torch
            torch.set_num_threads(num_threads)
        proc = EngineCoreProc(input_address, output_address, engine_index)
        try:
            proc.start_core(config, core_kwargs)
            proc.run_busy_loop()
            proc.engine_core.shutdown()
            code = 0
        except BaseException as error:  # noqa: BLE001 - the client must hear why
            logger.error("the engine core failed:\n%s", traceback.format_exc())
            proc.output_queue.put((DEAD, (type(error).__name__, str(error), engine_index)))
            code = 1
        proc.close()
        os._exit(code)   # at once: what is left to run at exit (torch's, zmq's) could only hang
