"""``DPEngineCoreProc``: one data-parallel engine core in a process of its own (vLLM:
``DPEngineCoreProc`` in ``vllm/v1/engine/core.py``).

``microvllm serve --data-parallel-size N`` starts N of these beside one API server. Each
is a whole engine — its own model copy, KV cache, scheduler and engine-core thread (an
``AsyncLLM``) — and knows nothing of the others: a dense model's replicas never talk
(vLLM syncs its DP ranks only for mixtures of experts, whose experts may be split over
them). The API server's ``DPAsyncLLM`` (``dp_async_llm.py``) talks to each over ZMQ::

    API server process                              engine core process i
    ──────────────────                              ─────────────────────
    DPAsyncLLM ── ROUTER ─ ("generate", id, prompt, params) ─> DEALER ─> AsyncLLM.generate
                         ─ ("abort", id) / ("abort_all",) / ("reset_prefix_cache",) / ("shutdown",)
               <─ PULL ─── ("output", id, RequestOutput) ───── PUSH  (every step it moves)
                           ("error", id, kind, message)               (a refused or failed request)
                           ("stats", i, waiting, running, kv usage, metrics text or None)
                                                                      (every 0.1 s busy, 0.5 s idle; the
                                                                       text at most every 0.5 s, and
                                                                       before each final output)

Messages are pickled: both ends are this package, on one machine (vLLM encodes its
``EngineCoreRequest`` with msgspec, which is faster and refuses arbitrary objects).
A core sends its stats before a request's last output, so when a client has its answer
the API server's ``/metrics`` already counts it.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import signal
import threading
import time

from microvllm.executor.multiproc_executor import _exit_when_orphaned
from microvllm.utils.gc_utils import freeze_gc_heap

STATS_INTERVAL_S = 0.5   # how often an idle core reports (its heartbeat: the API server's /health)
BUSY_STATS_INTERVAL_S = 0.1   # ... and a busy one (its queues: the load balancer's input)
MODEL_NAME = "{model_name}"   # stands for the served name in a core's metrics text

logger = logging.getLogger(__name__)


class DPEngineCoreProc:
    """Data-parallel rank ``index``: an ``AsyncLLM`` driven by the messages of one client."""

    def __init__(self, index: int, engine_kwargs: dict, input_address: str, output_address: str):
        import zmq
        import zmq.asyncio

        from microvllm.engine.async_llm import AsyncLLM

        self.index = index
        self.llm = AsyncLLM(**engine_kwargs)
        self.context = zmq.asyncio.Context()
        self.input = self.context.socket(zmq.DEALER)
        self.input.setsockopt(zmq.IDENTITY, f"core-{index}".encode())
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.connect(input_address)
        self.output = self.context.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 1000)
        self.output.connect(output_address)
        self.requests: dict[str, asyncio.Task] = {}

    async def send(self, message: tuple) -> None:
        await self.output.send(pickle.dumps(message))

    async def send_stats(self, with_text: bool = True) -> None:
        """Queue lengths (the load balancer's input), and the metrics text for ``/metrics``
        unless ``with_text`` is False (None: the client keeps the last one)."""
        metrics = self.llm.metrics
        text = metrics.render(MODEL_NAME) if with_text else None
        await self.send(("stats", self.index, metrics.num_requests_waiting, metrics.num_requests_running,
                         metrics.kv_cache_usage_perc, text))

    async def run(self) -> None:
        """Serve the client's messages until "shutdown" (or until the engine dies)."""
        await self.send(("ready", self.index, self.llm.engine.num_kv_blocks))
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            while True:
                message = pickle.loads(await self.input.recv())
                kind = message[0]
                if kind == "generate":
                    _, request_id, prompt, params = message
                    self.requests[request_id] = asyncio.create_task(self._generate(request_id, prompt, params))
                elif kind == "abort":
                    task = self.requests.pop(message[1], None)
                    if task is not None:
                        task.cancel()   # AsyncLLM.generate's cleanup aborts it: its blocks are freed
                elif kind == "abort_all":
                    self.llm.abort_all()
                elif kind == "reset_prefix_cache":
                    asyncio.create_task(self.llm.reset_prefix_cache())
                elif kind == "shutdown":
                    return
        finally:
            heartbeat.cancel()
            self.llm.shutdown()

    async def _generate(self, request_id: str, prompt, params) -> None:
        try:
            async for out in self.llm.generate(prompt, params, request_id):
                if out.finished:
                    await self.send_stats()   # counted before the client sees its answer
                await self.send(("output", request_id, out))
        except asyncio.CancelledError:
            pass
        except Exception as error:  # noqa: BLE001 - the client re-raises it as the same kind
            await self.send(("error", request_id, type(error).__name__, str(error)))
        finally:
            self.requests.pop(request_id, None)

    async def _heartbeat(self) -> None:
        rendered = 0.0   # the whole metrics text at most every STATS_INTERVAL_S: busy beats send counts
        while self.llm.is_running:
            now = time.monotonic()
            with_text = now - rendered >= STATS_INTERVAL_S
            await self.send_stats(with_text)
            rendered = now if with_text else rendered
            await asyncio.sleep(BUSY_STATS_INTERVAL_S if self.requests else STATS_INTERVAL_S)
        await self.send(("dead", self.index, repr(self.llm.dead_error)))

    @staticmethod
    def run_engine_core(index: int, engine_kwargs: dict, input_address: str, output_address: str,
                        num_threads: int, parent_pid: int) -> None:
        """The process's entry point (``multiprocessing`` spawn)."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the API server, which decides
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
        import torch
        torch.set_num_threads(num_threads)   # the ranks share this machine's cores
        try:
            proc = DPEngineCoreProc(index, engine_kwargs, input_address, output_address)
        except BaseException as error:
            _report_startup_failure(index, output_address, error)
            raise
        freeze_gc_heap()   # the model stays for the process's life: the collector skips it
        asyncio.run(proc.run())


def _report_startup_failure(index: int, output_address: str, error: BaseException) -> None:
    import zmq
    socket: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 2000)
    socket.connect(output_address)
    socket.send(pickle.dumps(("dead", index, f"startup failed: {error!r}")))
    socket.close()
