"""The tensor-parallel process group of this process (vLLM:
``vllm/distributed/parallel_state.py``).

A worker process of the ``MultiprocExecutor`` calls ``init_distributed_environment``
once, before it builds the model; the model's sharded layers then ask
``get_tp_group()`` how many ranks share each weight and which shard is theirs::

    rank 0 ─┐
    rank 1 ─┼── one process group (gloo on a CPU, NCCL on CUDA), created with a timeout:
    rank 2 ─┘   a dead peer raises, never hangs

The ranks find each other through a key-value store (``torch.distributed.TCPStore``) on
127.0.0.1 that the engine process serves (``serve_rendezvous``): it binds a port the
operating system picks, so no port is chosen first and taken by someone else before use
(vLLM's ``init_method="tcp://host:port"`` with a port found free beforehand has that race).

This module keeps that group in a module-level variable, as vLLM does: it is a fact
about the whole process (one process is one rank), not about any one engine, and
passing it down through every layer's constructor would obscure the model code.
Without a group (the engine process, ``tensor_parallel_size=1``) ``get_tp_group()``
returns a group of one, whose collectives return their input.

Expert parallelism (``enable_expert_parallel=True``, vLLM's flag) uses the same ranks
differently for the mixture-of-experts layers only: each rank holds whole experts (E / N
of them) instead of a 1/N slice of every expert. ``get_ep_group()`` is then the same
group of processes; without the flag it is a group of one, and the experts are sharded
like any MLP (``layers/fused_moe/layer.py``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class CommunicationStats:
    """What this rank's collectives cost so far (notebook 12 reads it to split a step's
    time into communication and compute). ``seconds`` is wall time inside the collectives,
    so it includes waiting for the slowest rank to arrive."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0      # this rank's tensors handed to the collectives


class GroupCoordinator:
    """The ranks that shard one model, and the collectives between them (vLLM's class of
    the same name, cut down to what tensor parallelism needs)."""

    def __init__(self, world_size: int = 1, rank_in_group: int = 0, device_group=None):
        self.world_size, self.rank_in_group = world_size, rank_in_group
        self.device_group = device_group   # a torch.distributed group; None for a group of one
        self.stats = CommunicationStats()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` summed, on every rank (in place)."""
        if self.world_size == 1:
            return x
        with self._counted(x):
            dist.all_reduce(x, group=self.device_group)
        return x

    @contextmanager
    def _counted(self, x: torch.Tensor):
        start = time.perf_counter()
        yield
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1
        self.stats.bytes += x.numel() * x.element_size()

    def all_to_all_single(self, x: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int]) -> torch.Tensor:
        """Send rows ``x[start_r : start_r + input_split_sizes[r]]`` to rank r; receive
        ``output_split_sizes[r]`` rows from each rank r, stacked in rank order::

            rank 0: [a0 a1 | b0]  splits in [2, 1]         rank 0 gets [a0 a1 | c0]
            rank 1: [c0 | d0 d1]  splits in [1, 2]  ──>    rank 1 gets [b0 | d0 d1]

        (gloo has this "single tensor" form with uneven splits; not the list form.)"""
        if self.world_size == 1:
            return x.clone()
        out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
        with self._counted(x):
            dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes,
                                   group=self.device_group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, rank 0's first, on every rank::

            rank 0: [T, V/2]   rank 1: [T, V/2]   ──>   every rank: [T, V]
        """
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        with self._counted(x):
            dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)


_TP: GroupCoordinator | None = None
_EP: GroupCoordinator | None = None   # the TP group's ranks when expert parallelism is on
_SINGLE = GroupCoordinator()


def serve_rendezvous(timeout_s: float = 60.0) -> dist.TCPStore:
    """The store the ranks meet at, served from this process on a port the OS picks
    (``store.port``), on every interface of this machine (another machine's ranks reach
    it at this machine's address: the Ray executor); keep it alive as long as the ranks run."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def init_distributed_environment(world_size: int, rank: int, store_port: int,
                                 backend: str = "gloo", timeout_s: float = 60.0,
                                 enable_expert_parallel: bool = False,
                                 store_host: str = "127.0.0.1") -> GroupCoordinator:
    """Join the process group as ``rank`` of ``world_size`` through the store on
    ``store_host``:``store_port`` (every rank must call it; it returns when all have). All ranks
    form one tensor-parallel group. ``timeout_s`` bounds the rendezvous and every
    collective: a rank whose peer died raises instead of waiting forever.
    ``enable_expert_parallel``: the same ranks also form the expert-parallel group."""
    global _TP, _EP
    if _TP is not None:
        raise RuntimeError("this process already belongs to a process group: one rank per process")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timeout)
    dist.init_process_group(backend=backend, store=store, world_size=world_size, rank=rank,
                            timeout=timeout)
    _TP = GroupCoordinator(world_size, rank, dist.group.WORLD)
    _EP = _TP if enable_expert_parallel else None
    return _TP


def get_tp_group() -> GroupCoordinator:
    """This process's tensor-parallel group (a group of one when there is none)."""
    return _TP if _TP is not None else _SINGLE


def get_ep_group() -> GroupCoordinator:
    """The expert-parallel group: the TP group's ranks with ``enable_expert_parallel``,
    else a group of one (each rank then holds a slice of every expert)."""
    return _EP if _EP is not None else _SINGLE


@contextmanager
def as_rank(world_size: int, rank: int, enable_expert_parallel: bool = False):
    """Build layers here, in this process, as rank ``rank`` of ``world_size`` would build
    them, to look at a rank's shards (notebook 12, the layer tests). There is no process
    group behind it: a collective run inside fails."""
    global _TP, _EP
    saved = _TP, _EP
    _TP = GroupCoordinator(world_size, rank)
    _EP = _TP if enable_expert_parallel else None
    try:
        yield _TP
    finally:
        _TP, _EP = saved


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def destroy_distributed_environment() -> None:
    """Leave and destroy the process group, if this process joined one."""
    global _TP, _EP
    _TP = _EP = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
