"""Attention backends by name: ``attention_backend="torch"`` -> ``TorchSDPABackend()``.

    name          class                                              what runs
    "reference"   attention/torch_ref.py     TorchReferenceBackend   per-request masked softmax: the oracle
    "torch"       attention/torch_sdpa.py    TorchSDPABackend        decodes in one SDPA call, chunks one each
    "triton"      attention/triton_backend.py TritonAttentionBackend the Triton kernels (the interpreter on a CPU)
    "cpu"         platforms/cpu/attention_backend.py                 the CPU platform's C++ kernels
    "auto"        the platform's default (``Platform.default_attention_backend``)

A built-in class is imported only when its name is chosen (a plain import inside the
function that loads it, which the layering test sees), so ``import microvllm`` never
imports triton, and no backend module imports this one (each names itself with
``name = ...``): no import cycle. ``register_backend`` adds a backend from above this
package: the CPU platform registers "cpu" when it is loaded (``get_platform("cpu")``), and
the course's exercises register theirs.
vLLM: ``vllm/attention/selector.py`` and ``vllm/attention/backends/registry.py``.
"""

from __future__ import annotations

from typing import Callable

from microvllm.attention.backend import AttentionBackend

AUTO = "auto"


def _reference_backend() -> type[AttentionBackend]:
    from microvllm.attention.torch_ref import TorchReferenceBackend
    return TorchReferenceBackend


def _torch_backend() -> type[AttentionBackend]:
    from microvllm.attention.torch_sdpa import TorchSDPABackend
    return TorchSDPABackend


def _triton_backend() -> type[AttentionBackend]:
    from microvllm.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend


# name -> a function that imports the class (only when that name is chosen)
BUILTIN_BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {
    "reference": _reference_backend,
    "torch": _torch_backend,
    "triton": _triton_backend,
}
_REGISTERED: dict[str, type[AttentionBackend]] = {}


def register_backend(name: str):
    """Class decorator: make a backend selectable as ``attention_backend=name``."""

    def wrap(cls):
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise TypeError(f"register_backend({name!r}) needs an AttentionBackend subclass, got {cls!r}")
        cls.name = name
        _REGISTERED[name] = cls
        return cls

    return wrap


def available_backends() -> list[str]:
    return sorted({*BUILTIN_BACKENDS, *_REGISTERED})


def get_attention_backend_class(name: str) -> type[AttentionBackend]:
    """The class named ``name`` (imported now); a clear error for an unknown name."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in BUILTIN_BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not known; choose {AUTO!r} or one of "
                         f"{available_backends()}")
    return BUILTIN_BACKENDS[name]()


def get_attention_backend(name: str) -> AttentionBackend:
    """An instance of the backend named ``name`` (not ``"auto"``: the platform resolves it)."""
    return get_attention_backend_class(name)()
