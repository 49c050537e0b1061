"""Attention backends by name: ``attention_backend="torch"`` -> ``TorchSDPABackend()``.

    name          class                                              what runs
    "reference"   attention/torch_ref.py     TorchReferenceBackend   per-request masked softmax: the oracle
    "torch"       attention/torch_sdpa.py    TorchSDPABackend        decodes in one SDPA call, chunks one each
    "triton"      attention/triton_backend.py TritonAttentionBackend the Triton kernels (the interpreter on a CPU)
    "cpu"         platforms/cpu/attention_backend.py                 the CPU platform's C++ kernels
    "auto"        the platform's default (``Platform.default_attention_backend``)

A class is imported only when its name is chosen, so ``import microvllm`` never imports
triton, and no backend module imports this one (each names itself with ``name = ...``):
no import cycle. ``register_backend`` adds your own (the course's exercises do).
vLLM: ``vllm/attention/selector.py`` and ``vllm/attention/backends/registry.py``.
"""

from __future__ import annotations

import importlib

from microvllm.attention.backend import AttentionBackend

AUTO = "auto"
BUILTIN_BACKENDS = {
    "reference": "microvllm.attention.torch_ref:TorchReferenceBackend",
    "torch": "microvllm.attention.torch_sdpa:TorchSDPABackend",
    "triton": "microvllm.attention.triton_backend:TritonAttentionBackend",
    "cpu": "microvllm.platforms.cpu.attention_backend:CPUAttentionBackend",
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
    module, _, cls = BUILTIN_BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def get_attention_backend(name: str) -> AttentionBackend:
    """An instance of the backend named ``name`` (not ``"auto"``: the platform resolves it)."""
    return get_attention_backend_class(name)()
