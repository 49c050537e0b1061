"""Call ``argmax.cpp``: greedy sampling's argmax over each row of the logits, on CPUs.

``Sampler`` takes greedy tokens through ``greedy_argmax``, which runs the kernel for a
float32 CPU tensor when ``argmax_status()`` is None (a compiler is present) and
``torch.argmax`` otherwise: the same ids either way (the first maximum; the first NaN
if a row has one).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from microvllm import cpp_extension

SOURCE = Path(__file__).with_name("argmax.cpp")


@functools.lru_cache(maxsize=None)
def load_argmax() -> ctypes.CDLL:
    """Build (if needed) and load the argmax kernel."""
    return cpp_extension.load_library(SOURCE, {
        "argmax_rows": (None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]),
    })


@functools.lru_cache(maxsize=None)
def argmax_status() -> str | None:
    """None if the argmax kernel is usable on this machine, else why not."""
    return cpp_extension.unavailable_reason(load_argmax)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits [rows, vocab]`` -> ``[rows]`` int64, equal to ``logits.argmax(dim=-1)``."""
    if not (logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
            and logits.shape[1] > 0 and argmax_status() is None):
        return logits.argmax(dim=-1)
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[0]:
        with cpp_extension.profiled("microvllm::greedy_argmax"):
            load_argmax().argmax_rows(logits.data_ptr(), out.data_ptr(), logits.shape[0],
                                      logits.shape[1])
    return out
