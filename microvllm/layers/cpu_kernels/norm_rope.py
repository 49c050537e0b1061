"""Call ``norm_rope.cpp``: RMSNorm (with the residual add fused in) and rotary embedding.

One pass each instead of seven or eight torch operators. ``RMSNorm`` and ``rotate`` use
them for float32 and bfloat16 CPU tensors when ``norm_rope_status()`` is None (a
compiler is present), and their torch code otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from microvllm import cpp_extension
from microvllm.cpp_extension import DTYPE_CODES

SOURCE = Path(__file__).with_name("norm_rope.cpp")
NORM_ROPE_DTYPES = (torch.float32, torch.bfloat16)   # what norm_rope.cpp handles


@functools.lru_cache(maxsize=None)
def load_norm_rope() -> ctypes.CDLL:
    """Build (if needed) and load the RMSNorm / RoPE kernels."""
    return cpp_extension.load_library(SOURCE, {
        "rms_norm": (None, [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 + [ctypes.c_float]),
        "rope": (None, [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_int64]),
    })


@functools.lru_cache(maxsize=None)
def norm_rope_status() -> str | None:
    """None if the RMSNorm / RoPE kernels are usable on this machine, else why not."""
    return cpp_extension.unavailable_reason(load_norm_rope)


def norm_rope_applies(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can go through the RMSNorm / RoPE kernels: float32 or
    bfloat16 CPU tensors of one dtype, no autograd, and the kernels built."""
    dtype = tensors[0].dtype
    return (dtype in NORM_ROPE_DTYPES
            and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and norm_rope_status() is None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x [rows, hidden]`` normalised, times ``weight``. With ``residual``, first
    ``residual += x`` in place and normalise that (see norm_rope.cpp)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm: weight must be [{hidden}] and residual {list(x.shape)}; "
                         f"got {list(weight.shape)} and "
                         f"{None if residual is None else list(residual.shape)}")
    x = x.contiguous()
    if residual is not None and not residual.is_contiguous():
        raise ValueError("rms_norm: residual is updated in place, so it must be contiguous")
    out = torch.empty_like(x)
    if x.numel():
        with cpp_extension.profiled("microvllm::rms_norm"):
            load_norm_rope().rms_norm(DTYPE_CODES[x.dtype], x.data_ptr(),
                                      residual.data_ptr() if residual is not None else None,
                                      weight.contiguous().data_ptr(), out.data_ptr(),
                                      x.numel() // hidden, hidden, eps)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every head of ``x [tokens, heads, head_dim]`` (a view whose heads are
    contiguous within a token, such as a slice of the fused QKV output) by its token's
    ``cos, sin [tokens, 1, head_dim / 2]``. Returns a new contiguous tensor."""
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        x = x.contiguous()
    cos, sin = cos.reshape(tokens, head_dim // 2).contiguous(), sin.reshape(tokens, head_dim // 2).contiguous()
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype)
    if x.numel():
        with cpp_extension.profiled("microvllm::rope"):
            load_norm_rope().rope(DTYPE_CODES[x.dtype], x.data_ptr(), cos.data_ptr(),
                                  sin.data_ptr(), out.data_ptr(), tokens, heads, head_dim,
                                  x.stride(0))
    return out
