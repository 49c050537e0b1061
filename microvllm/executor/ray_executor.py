"""``RayDistributedExecutor``: tensor parallelism over Ray actors, on one machine or
several (vLLM: ``vllm/v1/executor/ray_executor.py``; the actor is ``ray_utils.py``'s
``RayWorkerWrapper``). ``LLM(..., distributed_executor_backend="ray")``.

The same ranks as ``MultiprocExecutor`` (each builds a ``WorkerProc``: joins the process
group, loads its shard), but Ray starts them, in a cluster you started beforehand, so
they may sit on other machines::

    machine A: ray start --head                     machine B: ray start --address=A:6379
    ───────────────────────────────────────────     ─────────────────────────────────────
    engine process (the driver)                     raylet (Ray's agent on B)
      Scheduler ─ plan ─> RayDistributedExecutor      └─ actor rank 2: WorkerProc ─┐
        │ ray.put(plan): one copy, fetched by each node │                          │
        │ rank 0 ────────> actor rank 0: WorkerProc ─┐  │                          │
        │ rank 1 ────────> actor rank 1: WorkerProc ─┼──┼── gloo (CPU) / NCCL ─────┘
        │ rank 2 ─────────────────────────────────────┘     all-reduce, all-gather
        │ <── rank 0: ModelRunnerOutput; ranks 1..: None
      TCPStore (serve_rendezvous): the ranks meet here, at A's address

Placement: one bundle per rank (``{"CPU": 1}``, or ``{"GPU": 1}`` on CUDA) in one
placement group with strategy ``PACK``: as few machines as the ranks fit on. Every layer
all-reduces twice per step, so a rank on another machine puts a network round trip in
every layer; ``SPREAD`` would spread the ranks even when one machine has room for all of
them (``STRICT_SPREAD`` needs a machine per rank). vLLM packs too.

What must be reachable between the machines (a firewall must let these through):

- Ray's own: the head's GCS port (``ray start --head --port``, 6379) from every machine,
  and between all machines the raylet, object manager and worker ports Ray picks
  (``ray start --node-manager-port/--object-manager-port/--min-worker-port`` fix them);
- the rendezvous: a ``torch.distributed.TCPStore`` served by the engine process on a port
  the OS picks, on every interface; the ranks dial the driver's node IP (as Ray sees it);
- the collectives: gloo (CPU) or NCCL (CUDA) connect every rank to every other on ports
  they pick. Both choose a network interface from the host name; with several, name it:
  ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (set them before ``ray start``).

Every machine needs the same Python packages and the model folder at the same path.

Connecting: an existing ``ray.init`` is used as it is; else ``ray.init(address=$RAY_ADDRESS
or "auto")`` joins the cluster that ``ray start`` started. Without one this is an error
that says to run ``ray start --head``: we never start a private local cluster silently,
because ``ray start`` is one command, a cluster started by ``ray.init`` dies with this
process, and the lesson is the cluster (for one machine, ``distributed_executor_backend="mp"``
does the same with no Ray).

Lifecycle, and never hanging (as ``MultiprocExecutor``):
- every wait has a timeout (``ray.wait`` in slices of a second), and an address that does
  not answer is refused before ``ray.init`` (which would wait minutes);
- a dead actor (``ray.kill``, a crash, its machine gone) fails its call with Ray's
  ``RayActorError``: a ``WorkerError`` naming the rank and its machine, within seconds
  (a machine that vanishes: once Ray's health checks give up on it, tens of seconds). As
  with processes, a death is reported before the errors it causes on the other ranks;
- ``shutdown()`` (or garbage collection, or the interpreter's exit: ``weakref.finalize``)
  kills the actors and removes the placement group. If this process dies, Ray kills its
  actors itself (they belong to this driver); Ctrl-C reaches only this process.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from collections import Counter

from microvllm.distributed import serve_rendezvous
from microvllm.executor.abstract import Executor
from microvllm.executor.multiproc_executor import (
    CALL_TIMEOUT_S,
    PROCESS_GROUP_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    WorkerError,
    WorkerProc,
    raise_if_stopped,
)

PLACEMENT_TIMEOUT_S = 60.0   # the cluster must have a free CPU (GPU) per rank by then
DEATH_GRACE_S = 3.0          # after a rank's error, how long a peer's death may take to show
INSTALL_HINT = "pip install 'microvllm[ray]' (on every machine)"


def import_ray():
    """``ray``, imported here and not at package import: only this backend needs it."""
    try:
        import ray
    except ImportError:
        raise ImportError(f"distributed_executor_backend='ray' needs Ray: {INSTALL_HINT}") from None
    return ray


def connect_to_cluster():
    """Join the running cluster (``ray start``) unless this process already has."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    address = os.environ.get("RAY_ADDRESS") or "auto"
    start_it = ("start one with `ray start --head` (then `ray start --address=<head ip>:6379` on "
                "each other machine), or point RAY_ADDRESS=<head ip>:6379 at yours")
    if address.startswith("ray://"):
        raise ValueError(f"RAY_ADDRESS={address}: a Ray Client address; run the engine on a machine of the "
                         "cluster (after `ray start` there) with RAY_ADDRESS=<head ip>:6379 or unset")
    if address != "auto":   # ray.init waits minutes on an address that does not answer
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as error:
            raise ConnectionError(f"no Ray cluster answers at RAY_ADDRESS={address} ({error}): {start_it}") from None
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except ConnectionError as error:
        raise ConnectionError(f"no Ray cluster is running here ({error}): {start_it}") from None
    return ray


class RayWorkerWrapper:
    """One rank inside a Ray actor (vLLM: ``ray_utils.RayWorkerWrapper``): the actor starts
    empty, says where it landed, then builds its ``WorkerProc``."""

    def __init__(self) -> None:
        self.proc: WorkerProc | None = None

    def where(self) -> tuple[str, str, int]:
        """(Ray node id, node IP, pid) of this actor."""
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def start(self, rank, world_size, store_host, store_port, config, eos_token_ids, components,
              ranks_on_this_machine):
        # Ray shows an actor only its own GPU (CUDA_VISIBLE_DEVICES): it is device 0 here.
        self.proc = WorkerProc(rank, world_size, store_port, config, eos_token_ids, components,
                               store_host=store_host, ranks_on_this_machine=ranks_on_this_machine,
                               local_rank=0)
        return self.proc.startup_info()

    def execute_method(self, method: str, args: tuple):
        assert self.proc is not None, "start() first"
        return self.proc.run(method, args)


class RayDistributedExecutor(Executor):
    def __init__(self, config, eos_token_ids: set[int], platform, components=None):
        ray = self._ray = connect_to_cluster()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = config.parallel_config.tensor_parallel_size
        self._failed: str | None = None
        self._rendezvous = serve_rendezvous(PROCESS_GROUP_TIMEOUT_S)
        store_host = ray.util.get_node_ip_address()   # this machine, as the cluster sees it
        device = "GPU" if platform.name == "cuda" else "CPU"
        self.placement_group = placement_group([{device: 1}] * self.world_size, strategy="PACK")
        self.actors: list = []
        # Not a method of self: a finalizer that held self would keep it alive forever.
        self._finalizer = weakref.finalize(self, _stop_actors, self.actors, self.placement_group)
        self.locations: list[tuple[str, str, int]] = []   # per rank: (node id, IP, pid)
        try:
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self._fail(f"the Ray cluster has no room for {self.world_size} ranks of one {device} each "
                       f"after {PLACEMENT_TIMEOUT_S:.0f} s: it has {ray.available_resources().get(device, 0):g} "
                       f"{device} free of {ray.cluster_resources().get(device, 0):g} (`ray status`). Add "
                       "machines (`ray start --address=<head ip>:6379`) or lower tensor_parallel_size")
        node_of_bundle = ray.util.placement_group_table(self.placement_group)["bundles_to_node_id"]
        ranks_per_node = Counter(node_of_bundle.values())
        actor_class = ray.remote(RayWorkerWrapper)
        # An actor has its machine's environment, not this process's: send microvllm's own
        # settings (MICROVLLM_MOE_IMPL, ...), as a worker process would inherit them.
        settings = {name: value for name, value in os.environ.items() if name.startswith("MICROVLLM_")}
        for rank in range(self.world_size):
            self.actors.append(actor_class.options(
                num_cpus=1 if device == "CPU" else 0, num_gpus=1 if device == "GPU" else 0,
                runtime_env={"env_vars": settings} if settings else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank)).remote())
        self.locations = self._gather([actor.where.remote() for actor in self.actors], "startup",
                                      STARTUP_TIMEOUT_S, every_rank=True)
        self._layout, self._bytes_per_block = self._gather(
            [actor.start.remote(rank, self.world_size, store_host, self._rendezvous.port, config, eos_token_ids,
                                components, ranks_per_node[node_of_bundle[rank]])
             for rank, actor in enumerate(self.actors)], "startup", STARTUP_TIMEOUT_S)

    # ------------------------------------------------------------ the interface
    @property
    def kv_cache_layout(self):
        return self._layout

    def kv_cache_bytes_per_block(self) -> int:
        return self._bytes_per_block

    def shutdown(self) -> None:
        """Kill every actor and remove the placement group (idempotent)."""
        self._finalizer()

    # ------------------------------------------------------------------ calls
    def collective_rpc(self, method: str, *args, timeout_s: float = CALL_TIMEOUT_S):
        """Run ``Worker.<method>(*args)`` on every rank; return rank 0's result (vLLM's
        name). Raises ``WorkerError`` if an actor fails, dies or does not answer in time."""
        raise_if_stopped(self._failed, self._finalizer)
        # One copy in the object store, however many ranks: each node fetches it once. (An
        # ObjectRef passed as an argument reaches the actor as the object itself.)
        args_ref = self._ray.put(args)
        return self._gather([actor.execute_method.remote(method, args_ref) for actor in self.actors],
                            method, timeout_s)

    def _gather(self, refs: list, method: str, timeout_s: float, every_rank: bool = False):
        """Wait for every rank's answer (one ObjectRef each); return rank 0's, or all of
        them. ``ray.wait`` in slices of a second, so nothing waits past ``timeout_s``."""
        ray = self._ray
        deadline = time.monotonic() + timeout_s
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, object] = {}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(f"{method}() got no answer from ranks {sorted(pending.values())} in {timeout_s:.0f} s")
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(remaining, 1.0))
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref, timeout=0)   # ready: returns (or raises) at once
                except ray.exceptions.RayActorError as error:
                    self._fail(self._died(rank, method, error))
                except ray.exceptions.RayError as error:
                    # After a death the other ranks fail in their collectives ("Connection reset
                    # by peer"): the death is the root cause, so give it a moment to show.
                    died = self._first_death(pending, method)
                    if died is not None:
                        self._fail(f"{died}\nthen rank {rank} raised: {str(error).strip().splitlines()[-1]}")
                    self._fail(f"worker rank {rank} ({self._where(rank)}) raised in {method}():\n{error}")
        return [results[rank] for rank in range(len(refs))] if every_rank else results[0]

    def _first_death(self, pending: dict, method: str) -> str | None:
        """The message for a rank among ``pending`` (ObjectRef -> rank) whose actor died."""
        ray = self._ray
        if not pending:
            return None
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=DEATH_GRACE_S)
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as error:
                return self._died(pending[ref], method, error)
            except ray.exceptions.RayError:
                pass
        return None

    def _died(self, rank: int, method: str, error) -> str:
        # Unavailable: Ray lost contact with it (its machine, or its raylet, is gone).
        what = "became unreachable" if isinstance(error, self._ray.exceptions.ActorUnavailableError) else "died"
        reason = [line for line in str(error).strip().splitlines() if line.strip()]
        return (f"worker rank {rank} ({self._where(rank)}) {what} during {method}(): "
                f"{reason[-1].strip() if reason else type(error).__name__}")

    def _where(self, rank: int) -> str:
        if rank < len(self.locations):
            _, ip, pid = self.locations[rank]
            return f"Ray actor, pid {pid} on {ip}"
        return "Ray actor"

    def _fail(self, message: str):
        self._failed = message.splitlines()[0]
        self.shutdown()
        raise WorkerError(message)


def _stop_actors(actors: list, placement_group) -> None:
    """Kill every actor, then free their resources (the placement group)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    if not ray.is_initialized():
        return   # the driver has disconnected: Ray has killed its actors already
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:   # noqa: BLE001 - already dead, or Ray is shutting down
            pass
    try:
        remove_placement_group(placement_group)
    except Exception:   # noqa: BLE001
        pass
