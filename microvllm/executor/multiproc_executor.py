"""``MultiprocExecutor``: tensor parallelism over N worker processes (vLLM:
``vllm/v1/executor/multiproc_executor.py``).

The scheduler stays in the engine process. Each step, its plan reaches every rank;
every rank runs the same step on its shard of the model (the sharded layers all-reduce
between them over torch.distributed); rank 0's sampled tokens come back::

    engine process                                  worker processes (spawned)
    ──────────────                                  ──────────────────────────
    Scheduler ─ plan ─> MultiprocExecutor           WorkerProc rank 0: Worker ─┐
                          │ pipe 0 ───────────────> busy_loop: execute_model   │ gloo (CPU) /
                          │ pipe 1 ───────────────> WorkerProc rank 1: Worker ─┤ NCCL (CUDA)
                          │ ...                                  ...           │ all-reduce,
                          │ <── rank 0: ModelRunnerOutput                      │ all-gather
                          │ <── rank 1..: "ok" (or an error's traceback)      ─┘
    Scheduler.update_from_output(plan, rank 0's output)

Transport: one ``multiprocessing`` pipe per worker; the plan is pickled once per worker.
vLLM broadcasts the ``SchedulerOutput`` once through a shared-memory ring buffer
(``MessageQueue``) that every worker reads, and only rank 0 answers: faster for many
ranks, more machinery than a lesson needs. Here every rank answers, so an error on any
rank is seen at once.

Sampling: every rank gets all the logits (``LogitsProcessor`` all-gathers them) and runs
the same seeded sampler, so every rank's model runner appends the same tokens to its
requests; only rank 0's output is returned (vLLM V1 samples on every rank the same way).

Lifecycle, and never hanging:
- the workers start with the executor (``multiprocessing`` "spawn": a fresh interpreter,
  no forked torch state) and stop with it: ``shutdown()``, or when the executor is
  garbage collected or the interpreter exits (``weakref.finalize``, which runs at exit);
- workers ignore SIGINT (Ctrl-C in a terminal reaches every process of the group): the
  engine process decides; each worker also exits when its parent process is gone;
- everything the engine waits on has a timeout, and while it waits it polls each worker's
  liveness: a dead worker is an error within a fraction of a second, not a hang. The
  process group itself is created with a timeout, so a rank whose peer died raises;
- an exception in a worker comes back with the worker's traceback text. Either failure
  is fatal to the executor: the other ranks may be stuck in a collective, so every
  worker is stopped and later calls say so (vLLM's engine is dead after a worker dies too).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import wait

from microvllm.distributed import serve_rendezvous
from microvllm.executor.abstract import Executor

STARTUP_TIMEOUT_S = 600.0         # spawn, import torch, join the group, load the shard
CALL_TIMEOUT_S = 600.0            # one step (or any other call) on every rank
PROCESS_GROUP_TIMEOUT_S = 120.0   # a collective waiting on a missing peer raises after this
DEATH_GRACE_S = 1.0               # after a rank's error, how long a peer's death may take to show


_STARTUP_HINT = ("; its own error is printed above. In a script, create the LLM under "
                 "`if __name__ == \"__main__\":`: each worker process imports the script again "
                 "(multiprocessing's spawn)")


class WorkerError(RuntimeError):
    """A worker process failed or died: the executor has stopped all of them."""


@dataclass
class _Reply:
    call_id: int
    ok: bool
    value: object    # the result (rank 0's; None from the others), or the traceback text


class MultiprocExecutor(Executor):
    def __init__(self, config, eos_token_ids: set[int], platform, components=None):
        self.world_size = config.parallel_config.tensor_parallel_size
        self._call_ids = iter(range(1, 1 << 62))
        self._failed: str | None = None
        context = get_context("spawn")
        # Where the ranks meet (torch.distributed's TCPStore), served from here.
        self._rendezvous = serve_rendezvous(PROCESS_GROUP_TIMEOUT_S)
        self.procs, self.pipes = [], []
        for rank in range(self.world_size):
            ours, theirs = context.Pipe()
            proc = context.Process(
                target=WorkerProc.worker_main, name=f"microvllm-tp-rank{rank}", daemon=True,
                args=(rank, self.world_size, self._rendezvous.port, config, eos_token_ids,
                      components, theirs, os.getpid()))
            proc.start()
            theirs.close()   # the child's end: ours would keep it open after the child dies
            self.procs.append(proc)
            self.pipes.append(ours)
        # Not a method of self: a finalizer that held self would keep it alive forever.
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.pipes)
        self._layout, self._bytes_per_block = self._collect(0, "startup", STARTUP_TIMEOUT_S)

    # ------------------------------------------------------------ the interface
    @property
    def kv_cache_layout(self):
        return self._layout

    def kv_cache_bytes_per_block(self) -> int:
        return self._bytes_per_block

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""
        self._finalizer()

    # ------------------------------------------------------------------ calls
    def collective_rpc(self, method: str, *args, timeout_s: float = CALL_TIMEOUT_S):
        """Run ``Worker.<method>(*args)`` on every rank; return rank 0's result (vLLM's
        name). Raises ``WorkerError`` if a worker fails, dies or does not answer in time."""
        raise_if_stopped(self._failed, self._finalizer)
        call_id = next(self._call_ids)
        for rank, pipe in enumerate(self.pipes):
            try:
                pipe.send((call_id, method, args))
            except OSError:   # BrokenPipeError: that worker is already gone
                self._fail_if_a_worker_died(method, raised=None)
                self._fail(f"worker rank {rank} (pid {self.procs[rank].pid}) cannot be reached for {method}()")
        return self._collect(call_id, method, timeout_s)

    def _collect(self, call_id: int, method: str, timeout_s: float):
        """Wait for every rank's reply to call ``call_id``; wake up when a reply arrives or a
        worker process ends (its ``sentinel``), so a dead worker is noticed at once."""
        deadline = time.monotonic() + timeout_s
        replies: dict[int, _Reply] = {}
        while len(replies) < self.world_size:
            waiting = [rank for rank in range(self.world_size) if rank not in replies]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(f"{method}() got no answer from ranks {waiting} in {timeout_s:.0f} s")
            wait([self.pipes[r] for r in waiting] + [self.procs[r].sentinel for r in waiting],
                 timeout=min(remaining, 1.0))
            for rank in waiting:
                reply = _receive(self.pipes[rank])
                if reply is not None and reply.call_id != call_id:
                    continue   # it answers an older call, one that Ctrl-C interrupted
                if reply is not None and reply.ok:
                    replies[rank] = reply
                    continue
                # An error, or no answer yet. A death is the root cause: after one, the other
                # ranks fail in their collectives ("Connection reset by peer"), so it comes first.
                # A killed process closes its sockets before it can be reaped, so a peer's error
                # can arrive while the dead one still looks alive: give it a moment to show.
                if reply is not None and self.world_size > 1:
                    ended = wait([p.sentinel for r, p in enumerate(self.procs) if r != rank], timeout=DEATH_GRACE_S)
                    for proc in self.procs:
                        if proc.sentinel in ended:
                            proc.join(1)       # reap it: its exit code says "killed"
                self._fail_if_a_worker_died(method, raised=None if reply is None else (rank, str(reply.value)))
                pid = self.procs[rank].pid
                if reply is not None:
                    self._fail(f"worker rank {rank} (pid {pid}) raised in {method}():\n{reply.value}")
                if not self.procs[rank].is_alive():
                    # It may have died between the check above and this one: reap it, so that a
                    # kill is reported as a death with its exit code, whatever the timing.
                    self.procs[rank].join(1)
                    self._fail_if_a_worker_died(method, raised=None)
                    self._fail(f"worker rank {rank} (pid {pid}) exited during {method}() without answering")
        return replies[0].value

    def _fail_if_a_worker_died(self, method: str, raised: tuple[int, str] | None) -> None:
        """Fail naming the first worker that died (killed, crashed: a non-zero exit code; a
        worker that reported its error exits with 0), and, on a line of its own (whether a
        survivor notices first is a race), what another rank then raised."""
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive() and proc.exitcode != 0:
                message = (f"worker rank {rank} (pid {proc.pid}) died during {method}() "
                           f"with exit code {proc.exitcode}")
                if method == "startup":
                    message += _STARTUP_HINT
                if raised:
                    message += f"\nthen rank {raised[0]} raised: {raised[1].strip().splitlines()[-1]}"
                self._fail(message)

    def _fail(self, message: str):
        self._failed = message.splitlines()[0]
        self.shutdown()
        raise WorkerError(message)


def raise_if_stopped(failed: str | None, finalizer: weakref.finalize) -> None:
    """A call to ranks that an earlier failure (``failed``, its first line) or ``shutdown()``
    (the ``finalizer`` has run) stopped: a ``WorkerError`` that says to start again."""
    if failed is not None:
        raise WorkerError(f"the tensor-parallel workers were stopped after an earlier failure "
                          f"({failed}): create a new LLM")
    if not finalizer.alive:
        raise WorkerError("the executor was shut down: create a new LLM")


def _receive(pipe) -> _Reply | None:
    """The next reply on ``pipe``, or None if there is none yet (or the pipe is closed)."""
    try:
        return pipe.recv() if pipe.poll() else None
    except (EOFError, OSError):
        return None


def _stop_workers(procs, pipes, grace_s: float = 5.0) -> None:
    """Ask every worker to exit, then terminate (SIGTERM), then kill those still running."""
    for pipe in pipes:
        try:
            pipe.send((0, "shutdown", ()))
        except (OSError, ValueError):
            pass   # that worker is gone already
    for step in (lambda p: None, lambda p: p.terminate(), lambda p: p.kill()):
        deadline = time.monotonic() + grace_s
        for proc in procs:
            if proc.is_alive():
                step(proc)
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    for pipe in pipes:
        pipe.close()


class WorkerProc:
    """One rank, in its own process: joins the process group, builds a ``Worker`` over its
    shard of the model, then runs whatever the executor sends until told to stop. (The Ray
    executor's actors build one too: ``store_host`` is then the engine's machine, and
    ``ranks_on_this_machine`` and ``local_rank`` count only this machine's ranks.)"""

    def __init__(self, rank: int, world_size: int, store_port: int, config, eos_token_ids: set[int],
                 components=None, *, store_host: str = "127.0.0.1", ranks_on_this_machine: int | None = None,
                 local_rank: int | None = None):
        import torch

        from microvllm.distributed import init_distributed_environment
        from microvllm.platforms import platform_for
        from microvllm.worker.worker import Worker

        self.rank = rank
        # The ranks share this machine's cores: without this each would use all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (ranks_on_this_machine or world_size)))
        platform = platform_for(config.device_config)
        platform.set_device(rank if local_rank is None else local_rank)   # one GPU per rank (a CPU: nothing)
        init_distributed_environment(world_size, rank, store_port, backend=platform.distributed_backend,
                                     timeout_s=PROCESS_GROUP_TIMEOUT_S,
                                     enable_expert_parallel=config.parallel_config.enable_expert_parallel,
                                     store_host=store_host)
        self.worker = Worker(config, eos_token_ids, platform, components)

    def startup_info(self) -> tuple:
        """What the executor needs before its first call: the KV cache layout, one block's bytes."""
        return self.worker.model.layout, self.worker.kv_cache_bytes_per_block()

    def run(self, method: str, args: tuple):
        """``Worker.<method>(*args)``; only rank 0's result goes back (the ranks agree)."""
        result = getattr(self.worker, method)(*args)
        return result if self.rank == 0 else None

    @staticmethod
    def worker_main(rank, world_size, store_port, config, eos_token_ids, components,
                    pipe, parent_pid: int) -> None:
        """The worker process's entry point."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C: the engine process decides
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
        try:
            proc = WorkerProc(rank, world_size, store_port, config, eos_token_ids, components)
            pipe.send(_Reply(0, True, proc.startup_info()))
        except BaseException:
            pipe.send(_Reply(0, False, traceback.format_exc()))
            return
        try:
            proc.busy_loop(pipe)
        finally:
            from microvllm.distributed import destroy_distributed_environment
            destroy_distributed_environment()

    def busy_loop(self, pipe) -> None:
        """Run calls until "shutdown", or until the engine's end of the pipe closes."""
        while True:
            try:
                call_id, method, args = pipe.recv()
            except (EOFError, OSError):
                return
            if method == "shutdown":
                return
            try:
                reply = _Reply(call_id, True, self.run(method, args))
            except BaseException:
                reply = _Reply(call_id, False, traceback.format_exc())
            pipe.send(reply)


def _exit_when_orphaned(parent_pid: int) -> None:
    """Exit this worker if the engine process dies (it is then re-parented: a new ppid),
    even while the main thread waits inside a collective."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)
