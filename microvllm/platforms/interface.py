"""``Platform``: the one place that knows the hardware (vLLM: ``vllm/platforms/interface.py``).

The engine picks a platform once (``get_platform``) and asks it everything that depends
on the hardware; the engine, the worker, the executor, the model, its layers and the
sampler are plain, device-agnostic torch and never ask ``torch.cuda`` themselves::

    settling the config   default_dtype, resolve_dtype, resolve_attention_backend,
                          kv_cache_budget (what gpu_memory_utilization means here)
    the KV cache          memory_at_start() before loading, then num_kv_blocks_that_fit()
                          (a CPU: the byte budget; CUDA: a profiling pass and the readings);
                          allocate_kv_cache() for each layer's zeroed blocks
    the ops               process_weights_after_loading(): each CustomOp's version, once
    a decode-only step    decode_step_runner(model): the CPU fast path; CUDA graphs
    several ranks         distributed_backend ("gloo" / "nccl"), set_device(rank)

``enforce_eager=True`` is read here and nowhere else: it makes every answer the plain
one (``forward_native`` everywhere, no decode-step runner, no compiled attention
backend), whatever the subclass would otherwise choose.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from microvllm.attention.selector import available_backends
from microvllm.layers.custom_op import CustomOp

logger = logging.getLogger(__name__)


class Platform:
    name = "generic"
    device = torch.device("cpu")
    default_dtype = "float32"
    """What ``dtype="auto"`` becomes here."""
    eager_attention_backend = "torch"
    """What ``attention_backend="auto"`` becomes with ``enforce_eager=True``."""
    compiled_attention_backends: tuple[str, ...] = ()
    """Backends that run compiled kernels, which ``enforce_eager=True`` refuses."""
    distributed_backend = "gloo"
    """torch.distributed's backend between this platform's ranks."""

    def __init__(self, enforce_eager: bool = False):
        self.enforce_eager = enforce_eager

    # ------------------------------------------------------ settling the config
    def default_attention_backend(self) -> str:
        """The backend ``attention_backend="auto"`` runs here (without ``enforce_eager``)."""
        return "torch"

    def check_attention_backend(self, name: str) -> None:
        """Raise, saying what to change, if backend ``name`` cannot run here."""

    def resolve_attention_backend(self, name: str) -> str:
        """``"auto"`` -> this platform's default; any other name is checked and returned."""
        if name == "auto":
            return self.eager_attention_backend if self.enforce_eager else self.default_attention_backend()
        if self.enforce_eager and name in self.compiled_attention_backends:
            raise ValueError(f"attention_backend={name!r} runs compiled C++ kernels, which "
                             "enforce_eager=True turns off: choose attention_backend='torch' "
                             "(or 'auto'), or drop enforce_eager")
        self.check_attention_backend(name)
        if name not in available_backends():   # this platform's own ("cpu") are registered by now
            raise ValueError(f"attention_backend={name!r} is not known; choose 'auto' or one of "
                             f"{available_backends()}")
        return name

    def resolve_dtype(self, dtype: str) -> str:
        """``"auto"`` -> this platform's ``default_dtype``; any other name is returned."""
        return self.default_dtype if dtype == "auto" else dtype

    def kv_cache_budget(self, kv_cache_memory_bytes: int,
                        gpu_memory_utilization: float | None) -> tuple[int | None, float | None]:
        """``(kv_cache_memory_bytes, gpu_memory_utilization)`` as this platform sizes the
        cache; exactly one is set. Here (a CPU): a byte budget, of which vLLM's
        ``gpu_memory_utilization`` takes that fraction (vLLM's 0.4 of 1 GiB: 0.4 GiB)."""
        if gpu_memory_utilization is None:
            return kv_cache_memory_bytes, None
        budget = max(int(gpu_memory_utilization * kv_cache_memory_bytes), 1)
        logger.info("gpu_memory_utilization=%s: no GPU here; the KV cache may use %s of "
                    "kv_cache_memory_bytes = %.0f MiB", gpu_memory_utilization, gpu_memory_utilization,
                    budget / 2**20)
        return budget, None

    # ------------------------------------------------------- the KV cache's size
    def memory_at_start(self) -> object | None:
        """Readings to take before the worker loads anything (CUDA's free memory); None here."""
        return None

    def num_kv_blocks_that_fit(self, cache_config, bytes_per_block: int, profile_run: Callable[[], object],
                               memory_at_start: object | None) -> int:
        """KV blocks of ``bytes_per_block`` that fit the cache's budget. Here: the byte
        budget, no profiling (``profile_run`` runs the largest batch, for platforms that
        measure what it takes)."""
        return cache_config.kv_cache_memory_bytes // bytes_per_block

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One layer's KV cache, zeroed. Zeroed, not just allocated: attention reads the unused
        slots of a sequence's last block and multiplies them by a zero weight, and a stale
        NaN there would make the product NaN (vLLM zeroes its cache too)."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    # -------------------------------------------------------------- the ops
    def op_version(self, op: CustomOp) -> Callable | None:
        """This platform's version of ``op`` (same arguments and results as its
        ``forward_native``), or None to run ``forward_native``."""
        return None

    def process_weights_after_loading(self, module: nn.Module) -> None:
        """Give every ``CustomOp`` in ``module`` this platform's version of it (with
        ``enforce_eager``, none: each runs ``forward_native``). Called once the weights are
        loaded and cast, since a version may depend on them (packed weights, the dtype)."""
        chosen: dict[str, int] = {}
        for op in module.modules():
            if isinstance(op, CustomOp):
                op.use(None if self.enforce_eager else self.op_version(op))
                chosen[op.implementation] = chosen.get(op.implementation, 0) + 1
        if chosen:
            logger.debug("%s platform: ops run %s", self.name, chosen)

    # ------------------------------------------------------ a decode-only step
    def decode_step_runner(self, model: nn.Module, *, max_num_seqs: int = 1,
                           max_model_len: int | None = None) -> Callable | None:
        """What runs a decode-only step in the model's place (same arguments and result as
        ``model.forward``, with an ``applies(num_tokens, attn_metadata)`` test), or None:
        always None with ``enforce_eager``. ``max_num_seqs``, ``max_model_len``: the
        largest decode batch and sequence it will see."""
        if self.enforce_eager:
            return None
        return self.build_decode_step_runner(model, max_num_seqs=max_num_seqs, max_model_len=max_model_len)

    def build_decode_step_runner(self, model: nn.Module, *, max_num_seqs: int,
                                 max_model_len: int | None) -> Callable | None:
        """The subclass's decode-step runner (never called with ``enforce_eager``)."""
        return None

    # ----------------------------------------------------------- several ranks
    def set_device(self, rank: int) -> None:
        """Bind this process to rank ``rank``'s device (one GPU per rank); a CPU has one."""

    def describe(self) -> str:
        return f"{self.name}{' (enforce_eager: the plain torch code)' if self.enforce_eager else ''}"
