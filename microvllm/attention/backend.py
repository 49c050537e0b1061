"""The interface every attention backend implements, and the registry that picks one.

The model never knows which backend runs: its ``Attention`` layer calls
``backend.write_kv`` then ``backend.forward`` with explicit metadata (no global
"current context"). Backends are chosen by name, e.g. ``attention_backend="torch"``;
the default ``"auto"`` picks the compiled CPU kernel (``"cpu"``) when it builds here and
the torch backend otherwise.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Callable

import torch

from microvllm.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention over ``kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]``."""

    name: str = "abstract"

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store this step's keys/values (``[num_tokens, num_kv_heads, head_dim]``)
        into the cache at ``slot_mapping`` (vLLM: ``reshape_and_cache``)."""

    @abstractmethod
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                *, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        """Attend ``query [num_tokens, num_heads, head_dim]`` over each request's cached
        context (which already holds this step's keys) and return ``[num_tokens,
        num_heads, head_dim]``. Query heads are grouped onto KV heads
        (``num_heads // num_kv_heads`` per KV head: GQA; 1 KV head: MQA). With
        ``sliding_window=W`` a query at position ``p`` sees keys at ``p-W+1 .. p``."""


_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {}
AUTO = "auto"
logger = logging.getLogger("microvllm")


def register_backend(name: str):
    """Class decorator: make a backend selectable as ``attention_backend=name``."""

    def wrap(cls):
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return wrap


def available_backends() -> list[str]:
    _load_builtin_backends()
    return sorted(_REGISTRY)


def resolve_backend_name(name: str) -> str:
    """``"auto"`` -> ``"cpu"`` if its C++ kernel builds on this machine, else ``"torch"``
    (saying why); any other name is returned as it is."""
    if name != AUTO:
        return name
    from microvllm.attention import cpu_kernels
    reason = cpu_kernels.kernel_status()
    if reason is None:
        return "cpu"
    logger.warning("attention_backend='auto': using 'torch', because the CPU kernel is not "
                   "usable here: %s", reason)
    return "torch"


def get_attention_backend(name: str) -> AttentionBackend:
    """Instantiate the backend registered as ``name`` (or the one ``"auto"`` picks);
    raises a clear error for an unknown name."""
    _load_builtin_backends()
    name = resolve_backend_name(name)
    if name not in _REGISTRY:
        raise ValueError(
            f"attention_backend={name!r} is not known; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def _load_builtin_backends() -> None:
    # Imported lazily so that `import microvllm` never imports triton.
    from microvllm.attention import cpu_backend, torch_ref, torch_sdpa  # noqa: F401
    try:
        from microvllm.attention import triton_backend  # noqa: F401
    except ImportError:  # module not written yet / optional
        pass
