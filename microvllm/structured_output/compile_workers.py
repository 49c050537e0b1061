"""Grammar compiles in worker processes: what a server needs so that no spec can crash,
stall or bloat it.

A grammar compiler is native code whose cost grows faster than its input, and it can
fail in ways ``try`` cannot catch: xgrammar overflowed its stack (signal 11, the whole
server gone) on a JSON schema 4,000 objects deep. In a thread of the server there is no
defence: a thread cannot be killed, its crash is the process's crash, and a compile
whose client has gone keeps running. In a process of its own it can be all three::

    server process                                        compile worker (one process each)
    ──────────────                                        ─────────────────────────────────
    compile(kind, spec) on a compile thread
      take an idle worker (wait if all are busy)
      send (kind, spec, any_whitespace)       ──────────>   compiled = compiler.compile(...)
      poll the pipe every 50 ms:                            blob = compiler.dump(compiled)
        result        <── ("ok", blob) | ("error", msg) ─   (a bad spec: ValueError's message)
        worker died   (signal 11)      -> ValueError "the grammar compiler crashed on it"
        past the deadline              -> kill it; CompileTimeout
        past max_worker_rss_bytes      -> kill it; ValueError "took more than N MB"
        the client went away           -> kill it; CompileCancelled
      a killed or dead worker is replaced by a fresh one at once (it starts in ~1.5 s,
      importing xgrammar, while the next compile waits for an idle one)

The parent keeps none of the compiler's memory: a compile that takes 1 GB does so in
the worker, and a worker whose resident memory passes ``max_worker_rss_bytes`` is
stopped, while it compiles (read from /proc at each poll: a spec of 5,000 tools once
grew a worker to 20 GB before the compile ended) or after it. The price of the process boundary is one serialize and
one deserialize per compile (xgrammar's ``serialize_json``: ~7 ms for a small JSON
schema on a 2-core Xeon), which the manager's cache of compiled grammars pays once per
distinct spec.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing.connection
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import typing
from dataclasses import dataclass

logger = logging.getLogger(__name__)
POLL_SECONDS = 0.05
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class CompileTimeout(ValueError):
    """A compile ran past its time limit (the request gets a 400 saying so)."""


class CompileCancelled(Exception):
    """The request's client went away before its grammar compiled."""


@dataclass
class CompileJob:
    kind: object           # StructuredOutputOptions
    spec: str
    any_whitespace: bool


def _worker_main(fd: int) -> None:
    """A worker's whole life: receive its ``SpecCompiler``, then compile what comes and
    answer ("ok", blob, rss) or ("error", message, rss). Ctrl-C in a terminal reaches the
    whole process group: the server decides when its workers stop, not the signal."""
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    connection = multiprocessing.connection.Connection(fd)
    try:
        spec_compiler = connection.recv()
    except (EOFError, OSError):
        return
    while True:
        try:
            job = connection.recv()
        except (EOFError, OSError):   # the server closed the pipe: it is gone
            return
        try:
            compiled = spec_compiler.compile(job.kind, job.spec, job.any_whitespace)
            answer = ("ok", spec_compiler.dump(compiled))
        except ValueError as error:
            answer = ("error", str(error))
        except Exception as error:  # noqa: BLE001 - the server must hear of anything
            answer = ("error", f"structured_outputs.{getattr(job.kind, 'value', job.kind)} cannot be "
                               f"compiled: {type(error).__name__}: {error}")
        # ru_maxrss is in KiB on Linux (bytes on macOS: then it only over-reports).
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        connection.send((*answer, rss))


class _Worker:
    """One worker process and the server's end of its socket.

    A plain ``python -c`` child, not ``multiprocessing.Process``: a spawned Process
    re-imports the parent's main module (a user's script, a notebook's kernel, ``python
    -m microvllm serve``), and a forked one inherits the server's threads' locks."""

    def __init__(self, spec_compiler):
        ours, theirs = socket.socketpair()
        code = f"from microvllm.structured_output.compile_workers import _worker_main; _worker_main({theirs.fileno()})"
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                        stdin=subprocess.DEVNULL)
        theirs.close()
        self.connection = multiprocessing.connection.Connection(ours.detach())
        self.connection.send(spec_compiler)

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def rss(self) -> int | None:
        """Its resident memory now, in bytes (None where /proc cannot tell: not Linux)."""
        try:
            with open(f"/proc/{self.process.pid}/statm") as statm:
                return int(statm.read().split()[1]) * _PAGE_SIZE
        except (OSError, ValueError, IndexError):
            return None

    def kill(self) -> None:
        if self.is_alive():
            self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.connection.close()


class GrammarCompileWorkers:
    """``num_workers`` compile processes, each running one compile at a time.

        workers = GrammarCompileWorkers(backend.spec_compiler(), num_workers=1, timeout=30)
        blob = await workers.compile(job)      # or workers.compile_blocking(job, cancelled)
        workers.shutdown()                     # kills whatever is compiling
    """

    def __init__(self, spec_compiler, num_workers: int = 1, timeout: float = 30.0,
                 max_worker_rss_bytes: int = 2 << 30):
        if num_workers < 1:
            raise ValueError(f"structured_outputs_compile_workers={num_workers}: give at least 1")
        self.spec_compiler, self.timeout, self.max_worker_rss_bytes = spec_compiler, timeout, max_worker_rss_bytes
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._in_flight: set[threading.Event] = set()   # each running compile's cancel flag
        for _ in range(num_workers):
            self._add_worker()
        # One thread per worker waits on its pipe; jobs beyond that queue here.
        self._threads = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="microvllm-compile")

    def _add_worker(self) -> None:
        """Start a worker; it becomes idle once it took its compiler (the child imports
        xgrammar first, ~1.5 s: a background thread waits, not the caller)."""
        def start():
            worker = _Worker(self.spec_compiler)
            with self._lock:
                if self._closed:
                    worker.kill()
                    return
                self._workers.append(worker)
            self._idle.put(worker)

        threading.Thread(target=start, name="microvllm-compile-start", daemon=True).start()

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)
            closed = self._closed
        if not closed:
            self._add_worker()

    # ------------------------------------------------------------ compiling
    async def compile(self, job: CompileJob):
        """The compiled blob; ``ValueError`` (a bad spec, a crash, ``CompileTimeout``).
        Cancelling the awaiting task kills the compile."""
        import asyncio

        cancelled = threading.Event()
        future = self._threads.submit(self.compile_blocking, job, cancelled, time.monotonic())
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            cancelled.set()
            future.cancel()
            raise

    def compile_blocking(self, job: CompileJob, cancelled: threading.Event | None = None,
                         submitted: float | None = None):
        """Run ``job`` on an idle worker (waiting for one), within ``timeout`` seconds of
        ``submitted`` (default: now)."""
        submitted = time.monotonic() if submitted is None else submitted
        deadline = submitted + self.timeout
        cancelled = cancelled or threading.Event()
        with self._lock:
            self._in_flight.add(cancelled)
        try:
            return self._compile(job, cancelled, submitted, deadline)
        finally:
            with self._lock:
                self._in_flight.discard(cancelled)

    def cancel_all(self) -> None:
        """Stop every compile running or waiting now (``CompileCancelled`` for each); the
        workers are replaced and the pool goes on."""
        with self._lock:
            flags = list(self._in_flight)
        for flag in flags:
            flag.set()

    def _compile(self, job: CompileJob, cancelled: threading.Event, submitted: float, deadline: float):
        what = f"structured_outputs.{getattr(job.kind, 'value', job.kind)}"
        worker = self._take_idle(deadline, cancelled, what)
        started = time.monotonic()
        try:
            worker.connection.send(job)
        except (OSError, ValueError):   # it died while idle
            self._replace(worker)
            raise ValueError(f"{what} could not be compiled: the compile worker died; retry the request") from None
        while True:
            try:
                ready = worker.connection.poll(POLL_SECONDS)
            except OSError:   # shutdown() closed the pipe
                raise CompileCancelled() from None
            if ready:
                try:
                    status, value, rss = worker.connection.recv()
                except (EOFError, OSError):   # the pipe closed: the worker died
                    self._crashed(worker, what)
                if rss > self.max_worker_rss_bytes:
                    logger.info("a grammar compile worker grew to %.0f MB: replaced", rss / 2**20)
                    self._replace(worker)
                else:
                    self._idle.put(worker)
                if status == "error":
                    raise ValueError(value)
                return value
            if not worker.is_alive():
                self._crashed(worker, what)
            rss = worker.rss()
            if rss is not None and rss > self.max_worker_rss_bytes:   # growing past the bound: stop it now
                self._replace(worker)
                logger.warning("a grammar compile worker passed %.0f MB while compiling a %s spec: stopped",
                               rss / 2**20, what)
                raise ValueError(f"{what} took more than {self.max_worker_rss_bytes / 2**20:.0f} MB of memory to "
                                 "compile, so it was stopped: simplify it (fewer or smaller schemas, a grammar "
                                 "with fewer rules)")
            if cancelled.is_set():
                self._replace(worker)
                raise CompileCancelled()
            if time.monotonic() > deadline:
                self._replace(worker)
                raise CompileTimeout(
                    f"{what} took longer than {self.timeout:g} s to compile ({time.monotonic() - started:.1f} s "
                    f"compiling, {started - submitted:.1f} s waiting for a compile worker), so it was stopped: "
                    "simplify it, or start the server with a larger --structured-outputs-compile-timeout")

    def _crashed(self, worker: _Worker, what: str) -> typing.NoReturn:
        try:
            worker.process.wait(1)
        except subprocess.TimeoutExpired:
            pass
        code = worker.exitcode
        self._replace(worker)
        reason = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
        logger.warning("the grammar compiler crashed (%s) on a %s spec; the server goes on", reason, what)
        raise ValueError(f"{what} cannot be compiled: the grammar compiler crashed on it ({reason}); "
                         "simplify it (a schema nested less deeply, a smaller grammar)")

    def _take_idle(self, deadline: float, cancelled: threading.Event, what: str) -> _Worker:
        while True:
            if self._closed:
                raise CompileCancelled()
            try:
                return self._idle.get(timeout=POLL_SECONDS)
            except queue.Empty:
                pass
            if cancelled.is_set():
                raise CompileCancelled()
            if time.monotonic() > deadline:
                raise CompileTimeout(f"{what} waited {self.timeout:g} s for a compile worker (every one was busy "
                                     "with other requests' grammars): retry later, or start the server with more "
                                     "--structured-outputs-compile-workers")

    def shutdown(self) -> None:
        """Kill every worker, whatever it is compiling; waiting compiles are cancelled."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
            self._workers.clear()
        for worker in workers:
            worker.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)
