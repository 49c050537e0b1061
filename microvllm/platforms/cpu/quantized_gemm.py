"""The CPU platform's version of a quantized ``Linear``: C++ on the stored blocks.

    weight (layers/quantization/)   rows per call <= 64             more rows (a prefill)
    GGUF Q4_1, Q8_0; int8           quantized_linear.cpp: a few      dequantize_rows into a
                                    rows in registers, more through  temporary float32 weight,
                                    48 dequantized rows in L2        then F.linear (oneDNN/MKL)
    GGUF Q4_1, Q8_0 on an AMX CPU   from 5 rows, amx_quantized_linear.h (the integers on AMX
                                    tiles), up to 256 rows: Q4_1 beats dequantizing + oneDNN
                                    to ~512 rows here
    GGUF F16, anything else         forward_native (dequantize in torch, F.linear)

A decode step is bound by the bytes of weights it reads; the fused kernel reads each
weight once per call in its stored size and never keeps a float copy. A prefill is bound
by arithmetic instead, where the BLAS library's tuned GEMM wins: there the weight is
dequantized for the call (one layer's worth of float32 at a time) and dropped.

Every version computes ``F.linear(x, dequantized W, bias)`` up to float rounding
(tests/platforms/test_quantized_gemm.py checks against the torch dequantization on random
inputs); inputs the kernel does not take (not float32, autograd) go to ``forward_native``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from microvllm.layers.quantization.gguf import GGUFLinearMethod
from microvllm.layers.quantization.int8 import Int8LinearMethod
from microvllm.platforms.cpu import kernels

FORMATS = {"Q4_1": 0, "Q8_0": 1, "int8": 2}   # quantized_linear.cpp's format numbers
# More rows than this: dequantize, then F.linear. On AVX2 (-march=x86-64-v3, torch capped
# to AVX2, one thread, the embedded model's Q4_1 shapes) the kernel leads up to 32 rows
# (2.9-3.0 ms against 3.2-3.5), ties at 48 (4.2 / 3.9-4.2) and trails at 64 (5.4-5.5 /
# 4.7-4.8); kept at 64 on every target because the decode fast path, which has no
# dequantize route, serves batches up to this size too.
MAX_FUSED_ROWS = 64
AMX_FUSED_ROWS = 256   # the same for Q4_1 and Q8_0 on AMX tiles
ROW_GROUP = 4          # the kernel needs N to be a multiple of this


def status() -> str | None:
    """None if the kernels build and load here, else why not."""
    return kernels.status("quantized_linear")


def runs_on_amx(fmt: str, out_features: int) -> bool:
    """Whether ``quantized_linear`` multiplies this weight on AMX tiles here, from 5 rows
    (amx_quantized_linear.h)."""
    return fmt in ("Q4_1", "Q8_0") and out_features % 16 == 0 and status() is None \
        and kernels.load("quantized_linear").quantized_amx_ready() == 1


def weight_format(linear) -> str | None:
    """``"Q4_1"``, ``"Q8_0"`` or ``"int8"``: the kernel format of this layer's weight, or None."""
    method = linear.quant_method
    if isinstance(method, GGUFLinearMethod) and method.type.name in FORMATS:
        return method.type.name
    if isinstance(method, Int8LinearMethod):
        return "int8"
    return None


def _check(fmt: str, weight: torch.Tensor, n: int, k: int, scales: torch.Tensor | None) -> None:
    row_bytes = {"Q4_1": k // 32 * 20, "Q8_0": k // 32 * 34, "int8": k}[fmt]
    if weight.shape != (n, row_bytes) or not weight.is_contiguous() or weight.device.type != "cpu":
        raise ValueError(f"a {fmt} [{n}, {k}] weight must be a contiguous CPU tensor [{n}, {row_bytes}], "
                         f"got {list(weight.shape)}")
    if fmt != "int8" and k % 32:
        raise ValueError(f"{fmt} rows are blocks of 32 weights: K={k} is not a multiple of 32")
    if (fmt == "int8") != (scales is not None) or (scales is not None and (
            scales.dtype != torch.float32 or scales.shape != (n,) or not scales.is_contiguous())):
        raise ValueError("int8 weights need float32 scales [N] (and only they do)")


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, fmt: str, out_features: int,
                     bias: torch.Tensor | None = None, scales: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` in float32, ``W`` as stored in format ``fmt``."""
    m, k = x.shape
    _check(fmt, weight, out_features, k, scales)
    if x.dtype != torch.float32 or out_features % ROW_GROUP:
        raise ValueError(f"x must be float32 and N a multiple of {ROW_GROUP}; got {x.dtype}, N={out_features}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)):
        raise ValueError(f"bias must be float32 [{out_features}]")
    x = x.contiguous()
    out = torch.empty(m, out_features, dtype=torch.float32)
    if m:
        lib = kernels.load("quantized_linear")
        bias_ptr = bias.contiguous().data_ptr() if bias is not None else None
        with kernels.profiled(f"microvllm::{fmt.lower()}_linear"):
            if fmt == "int8":
                lib.int8_linear(x.data_ptr(), weight.data_ptr(), scales.data_ptr(), bias_ptr, out.data_ptr(),
                                m, out_features, k)
            else:
                getattr(lib, f"{fmt.lower()}_linear")(x.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(),
                                                      m, out_features, k)
    return out


def dequantize_weight(weight: torch.Tensor, fmt: str, out_features: int, in_features: int,
                      scales: torch.Tensor | None = None) -> torch.Tensor:
    """The whole weight as float32 ``[N, K]``, dequantized in C++ (threads split the rows)."""
    _check(fmt, weight, out_features, in_features, scales)
    out = torch.empty(out_features, in_features, dtype=torch.float32)
    with kernels.profiled("microvllm::dequantize_rows"):
        kernels.load("quantized_linear").dequantize_rows(
            FORMATS[fmt], weight.data_ptr(), scales.data_ptr() if scales is not None else None,
            out.data_ptr(), out_features, in_features)
    return out


class QuantizedLinear:
    """A quantized ``Linear``'s CPU version (bound by ``CpuPlatform.op_version``)."""

    def __init__(self, linear, fmt: str):
        self.linear, self.format = linear, fmt
        self.max_fused_rows = AMX_FUSED_ROWS if runs_on_amx(fmt, linear.out_features) else MAX_FUSED_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        if x.dtype != torch.float32 or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
            return linear.forward_native(x)
        rows = x.reshape(-1, linear.in_features)
        scales = getattr(linear, "weight_scale", None) if self.format == "int8" else None
        if rows.shape[0] <= self.max_fused_rows:
            out = quantized_linear(rows, linear.weight, self.format, linear.out_features, linear.bias, scales)
        else:
            weight = dequantize_weight(linear.weight, self.format, linear.out_features, linear.in_features, scales)
            out = F.linear(rows, weight, linear.bias)
        return out.view(*x.shape[:-1], linear.out_features)


def quantized_linear_version(linear) -> QuantizedLinear | None:
    """The CPU version of a quantized ``Linear``, or None to keep ``forward_native``."""
    fmt = weight_format(linear)
    if fmt is None or linear.out_features % ROW_GROUP or status() is not None:
        return None
    return QuantizedLinear(linear, fmt)
