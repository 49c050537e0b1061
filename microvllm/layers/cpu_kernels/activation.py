"""Call ``activation.cpp``: the SiLU-gated MLP activation (``silu_and_mul``) in one pass.

``layers/activation.py`` uses it for float32 and bfloat16 CPU tensors when
``activation_status()`` is None (a compiler is present), and its torch code otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from microvllm import cpp_extension
from microvllm.cpp_extension import DTYPE_CODES
from microvllm.layers.cpu_kernels.norm_rope import NORM_ROPE_DTYPES

SOURCE = Path(__file__).with_name("activation.cpp")


@functools.lru_cache(maxsize=None)
def load_activation() -> ctypes.CDLL:
    """Build (if needed) and load the activation kernel."""
    return cpp_extension.load_library(SOURCE, {
        "silu_and_mul": (None, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]),
    })


@functools.lru_cache(maxsize=None)
def activation_status() -> str | None:
    """None if the activation kernel is usable on this machine, else why not."""
    return cpp_extension.unavailable_reason(load_activation)


def activation_applies(gate_up: torch.Tensor) -> bool:
    """Whether ``gate_up`` can go through the kernel: a float32 or bfloat16 CPU tensor
    with an even last dimension, no autograd, and the kernel built."""
    return (gate_up.dtype in NORM_ROPE_DTYPES and gate_up.device.type == "cpu"
            and gate_up.dim() >= 1 and gate_up.shape[-1] % 2 == 0
            and not (torch.is_grad_enabled() and gate_up.requires_grad)
            and activation_status() is None)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [..., 2·d]`` -> ``silu(gate) * up`` ``[..., d]``, rounding as torch does."""
    d = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = torch.empty(*gate_up.shape[:-1], d, dtype=gate_up.dtype)
    if out.numel():
        with cpp_extension.profiled("microvllm::silu_and_mul"):
            load_activation().silu_and_mul(DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(),
                                           out.data_ptr(), out.numel() // d, d)
    return out
