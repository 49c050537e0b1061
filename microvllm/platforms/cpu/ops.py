"""The CPU platform's versions of the model's small ops, each one C++ pass:

    op (layers/, sample/)   kernel (csrc/)                        instead of
    RMSNorm                 norm_rope.cpp  rms_norm (+ residual)  7-8 torch operators
    ApplyRotaryEmb          norm_rope.cpp  rope                   chunk, 4 muls, 2 adds, cat
    SiluAndMul              activation.cpp silu_and_mul           chunk, silu, mul
    Argmax (the sampler)    argmax.cpp     argmax_rows            torch.argmax's generic reduction

Each wrapper checks what C++ cannot (dtypes, shapes, contiguity), then calls the
kernel; each kernel rounds where the torch code rounds, so the tokens are the same.
``*_forward`` are the versions the platform hands to the ops (``CustomOp.use``): they
take the op's ``forward_native`` arguments, and inputs the kernel does not take (a
float16 tensor, one that needs a gradient) go to ``forward_native``.
"""

from __future__ import annotations

import torch

from microvllm.platforms.cpu import kernels
from microvllm.platforms.cpu.kernels import DTYPE_CODES

DTYPES = (torch.float32, torch.bfloat16)   # what norm_rope.cpp and activation.cpp handle


def applies(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can go through the kernels: float32 or bfloat16 CPU
    tensors of one dtype, and no autograd."""
    dtype = tensors[0].dtype
    return (dtype in DTYPES and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


# ---------------------------------------------------------------- the kernels

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
        with kernels.profiled("microvllm::rms_norm"):
            kernels.load("norm_rope").rms_norm(
                DTYPE_CODES[x.dtype], x.data_ptr(), residual.data_ptr() if residual is not None else None,
                weight.contiguous().data_ptr(), out.data_ptr(), x.numel() // hidden, hidden, eps)
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
        with kernels.profiled("microvllm::rope"):
            kernels.load("norm_rope").rope(DTYPE_CODES[x.dtype], x.data_ptr(), cos.data_ptr(),
                                           sin.data_ptr(), out.data_ptr(), tokens, heads, head_dim,
                                           x.stride(0))
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [..., 2·d]`` -> ``silu(gate) * up`` ``[..., d]``, rounding as torch does."""
    d = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = torch.empty(*gate_up.shape[:-1], d, dtype=gate_up.dtype)
    if out.numel():
        with kernels.profiled("microvllm::silu_and_mul"):
            kernels.load("activation").silu_and_mul(DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(),
                                                    out.data_ptr(), out.numel() // d, d)
    return out


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits [rows, vocab]`` float32 -> ``[rows]`` int64, equal to ``logits.argmax(dim=-1)``
    (the first maximum; the first NaN if a row has one)."""
    if not (logits.dtype == torch.float32 and logits.dim() == 2 and logits.device.type == "cpu"
            and logits.shape[1] > 0):
        raise ValueError(f"greedy_argmax takes float32 [rows, vocab > 0] CPU logits, got "
                         f"{logits.dtype} {list(logits.shape)} on {logits.device}")
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[0]:
        with kernels.profiled("microvllm::greedy_argmax"):
            kernels.load("argmax").argmax_rows(logits.data_ptr(), out.data_ptr(), logits.shape[0],
                                               logits.shape[1])
    return out


# ------------------------------------------------- the ops' CPU versions

def rms_norm_forward(norm, x: torch.Tensor, residual: torch.Tensor | None = None):
    """``RMSNorm``: one pass, the residual updated in place (as vLLM's ``fused_add_rms_norm``)."""
    if not applies(x, norm.weight, *(() if residual is None else (residual,))):
        return norm.forward_native(x, residual)
    out = rms_norm(x, norm.weight, norm.eps, residual)
    return out if residual is None else (out, residual)


def rope_forward(op, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``ApplyRotaryEmb``: one pass over the query and key heads."""
    return rope(x, cos, sin) if applies(x, cos, sin) else op.forward_native(x, cos, sin)


def silu_and_mul_forward(op, gate_up: torch.Tensor) -> torch.Tensor:
    """``SiluAndMul``: one pass."""
    if applies(gate_up) and gate_up.dim() >= 1 and gate_up.shape[-1] % 2 == 0:
        return silu_and_mul(gate_up)
    return op.forward_native(gate_up)


def argmax_forward(op, logits: torch.Tensor) -> torch.Tensor:
    """``Argmax``: two vector passes per row."""
    if logits.dtype == torch.float32 and logits.dim() == 2 and logits.device.type == "cpu" and logits.shape[1]:
        return greedy_argmax(logits)
    return op.forward_native(logits)
