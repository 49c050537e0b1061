"""``CpuPlatform``: which CPU version each op, attention and a decode step get (the
package's ``__init__`` has the map of this folder)."""

from __future__ import annotations

import functools
import logging
import math
import mmap
from typing import Callable

import torch
from torch import nn

from microvllm.layers.activation import SiluAndMul
from microvllm.layers.custom_op import CustomOp
from microvllm.layers.layernorm import RMSNorm
from microvllm.layers.linear import Linear
from microvllm.layers.rotary_embedding import ApplyRotaryEmb
from microvllm.platforms.cpu import decode_fast_path, kernels, ops, quantized_gemm, sampling
from microvllm.platforms.cpu.gemm import PackedLinear
from microvllm.platforms.interface import Platform
from microvllm.sample.sampler import Argmax, RandomSample

logger = logging.getLogger(__name__)

# op class -> (its CPU version, the kernel library it needs, None: plain torch); the GEMM
# needs none of its own: PackedGemm falls back to oneDNN or F.linear per weight.
_OPS = {
    RMSNorm: (ops.rms_norm_forward, "norm_rope"),
    ApplyRotaryEmb: (ops.rope_forward, "norm_rope"),
    SiluAndMul: (ops.silu_and_mul_forward, "activation"),
    Argmax: (ops.argmax_forward, "argmax"),
    RandomSample: (sampling.random_sample_forward, None),
}


class CpuPlatform(Platform):
    name = "cpu"
    compiled_attention_backends = ("cpu",)

    def default_attention_backend(self) -> str:
        reason = kernels.status("paged_attention")
        if reason is None:
            return "cpu"
        logger.warning("attention_backend='auto': using 'torch', because the CPU kernel is not "
                       "usable here: %s", reason)
        return "torch"

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeroed pages from the operating system, each mapped when first touched.
        ``torch.zeros`` would write every byte of the cache before the first request (the
        default 1 GiB: about 1.5 s of a 2 s start on a 2-core machine) and make all of it
        resident whether requests ever fill it or not. The same zeros either way, so this
        holds with ``enforce_eager`` too: it is memory, not a code path."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(pages, dtype=dtype).view(shape)   # the tensor keeps ``pages`` alive

    def op_version(self, op: CustomOp) -> Callable | None:
        if isinstance(op, Linear):
            if op.quant_method is not None:   # GGUF / int8 weights: kernels on the packed blocks
                return quantized_gemm.quantized_linear_version(op)
            return PackedLinear(op)
        for cls, (version, library) in _OPS.items():
            if isinstance(op, cls):
                if library is not None and kernels.status(library) is not None:
                    return None
                return functools.partial(version, op)
        return None

    def build_decode_step_runner(self, model: nn.Module, **limits) -> Callable | None:
        reason = decode_fast_path.unsupported_reason(model)
        if reason is not None:
            logger.info("decode fast path off: %s", reason)
            return None
        return decode_fast_path.DecodeFastPath(model)
