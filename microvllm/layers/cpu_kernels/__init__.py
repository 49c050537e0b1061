"""Call the C++ kernels of the model's layers on CPUs.

``amx_linear.cpp``: bfloat16 projections on Intel AMX matrix units. ``PackedGemm``
(layers/linear.py) uses it for bfloat16 weights at decode sizes when ``amx_status()`` is
None: the CPU has AMX, Linux lets the process use it, and a compiler is present. Each
weight is packed once, at load time, into AMX tiles (``pack_weight``); every call then
streams it straight through the matrix units (see the .cpp file's header).

``norm_rope.cpp``: RMSNorm (with the residual add fused in) and rotary embedding, one
pass each instead of seven or eight torch operators. ``RMSNorm`` and ``rotate`` use them
for float32 and bfloat16 CPU tensors when ``norm_rope_status()`` is None (a compiler is
present), and their torch code otherwise.

Each falls back, where it cannot run, to torch code with the same results up to float
rounding.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from microvllm import cpp_extension
from microvllm.cpp_extension import DTYPE_CODES, KernelUnavailable

AMX_SOURCE = Path(__file__).with_name("amx_linear.cpp")
NORM_ROPE_SOURCE = Path(__file__).with_name("norm_rope.cpp")
NORM_ROPE_DTYPES = (torch.float32, torch.bfloat16)   # what norm_rope.cpp handles
TILE_N, TILE_K = 16, 32          # a weight tile: 16 output columns x 32 inputs
REQUIRED_CPU_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16")


# ---------------------------------------------------------------- AMX linear
@functools.lru_cache(maxsize=None)
def load_amx() -> ctypes.CDLL:
    """Build (if needed) and load the AMX kernel, and get Linux's permission to use AMX."""
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in cpp_extension.cpu_flags()]
    if missing:
        raise KernelUnavailable(f"this CPU lacks {', '.join(missing)} (AMX): bfloat16 "
                                "projections use oneDNN instead")
    lib = ctypes.CDLL(str(cpp_extension.build(AMX_SOURCE)))
    if lib.amx_init() != 0:
        raise KernelUnavailable("Linux refused this process the AMX tile registers "
                                "(arch_prctl ARCH_REQ_XCOMP_PERM needs Linux 5.16 or newer)")
    lib.amx_linear.restype = None
    lib.amx_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3
    return lib


@functools.lru_cache(maxsize=None)
def amx_status() -> str | None:
    """None if the AMX kernel is usable on this machine, else the reason it is not."""
    return cpp_extension.unavailable_reason(load_amx)


def supports(weight: torch.Tensor) -> bool:
    """Whether this weight can go through the kernel here: bfloat16 on a CPU, a shape
    made of whole tiles, and the kernel usable on this machine."""
    n, k = weight.shape
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and n % TILE_N == 0 and k % TILE_K == 0 and amx_status() is None)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` -> ``[N/16, K/32, 16, 16, 2]``: one 1 KiB AMX tile per (n block,
    k block), whose row ``r`` holds inputs ``2r, 2r+1`` of the block's 16 columns
    ("VNNI" order, what ``tdpbf16ps`` reads)::

        packed[nb, kb, r, n, e] = W[16*nb + n, 32*kb + 2*r + e]
    """
    n, k = weight.shape
    if not supports(weight):
        raise ValueError(f"cannot pack a {weight.dtype} [{n}, {k}] weight for AMX: it needs "
                         f"bfloat16, N % {TILE_N} == 0, K % {TILE_K} == 0 and an AMX CPU "
                         f"({amx_status() or 'this one has it'})")
    tiles = weight.detach().reshape(n // TILE_N, TILE_N, k // TILE_K, TILE_K // 2, 2)
    return tiles.permute(0, 2, 3, 1, 4).contiguous()


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` in bfloat16, with ``packed = pack_weight(W)``."""
    num_n_blocks, num_k_blocks = packed.shape[:2]
    n, k = num_n_blocks * TILE_N, num_k_blocks * TILE_K
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be bfloat16 [M, {k}], got {x.dtype} {list(x.shape)}")
    if packed.dtype != torch.bfloat16 or packed.shape[2:] != (TILE_K // 2, TILE_N, 2):
        raise ValueError("packed must come from pack_weight")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,)):
        raise ValueError(f"bias must be bfloat16 [{n}], got {bias.dtype} {list(bias.shape)}")
    x = x.contiguous()
    for name, t in (("x", x), ("packed", packed), ("bias", bias)):
        if t is not None and (t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    if x.shape[0]:
        with cpp_extension.profiled("microvllm::amx_linear"):
            load_amx().amx_linear(x.data_ptr(), packed.data_ptr(),
                                  bias.data_ptr() if bias is not None else None, out.data_ptr(),
                                  x.shape[0], n, k)
    return out


# ---------------------------------------------------------------- RMSNorm, RoPE
@functools.lru_cache(maxsize=None)
def load_norm_rope() -> ctypes.CDLL:
    """Build (if needed) and load the RMSNorm / RoPE kernels."""
    lib = ctypes.CDLL(str(cpp_extension.build(NORM_ROPE_SOURCE)))
    lib.rms_norm.restype = lib.rope.restype = None
    lib.rms_norm.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 + [ctypes.c_float]
    lib.rope.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_int64]
    return lib


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

