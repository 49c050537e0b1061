"""``CpuPlatform``: which CPU version each op, attention and a decode step get (the
package's ``__init__`` has the map of this folder)."""

from __future__ import annotations

import functools
import logging
from typing import Callable

from torch import nn

from microvllm.layers.activation import SiluAndMul
from microvllm.layers.custom_op import CustomOp
from microvllm.layers.layernorm import RMSNorm
from microvllm.layers.linear import Linear
from microvllm.layers.rotary_embedding import ApplyRotaryEmb
from microvllm.platforms.cpu import decode_fast_path, kernels, ops
from microvllm.platforms.cpu.gemm import PackedLinear
from microvllm.platforms.interface import Platform
from microvllm.sample.sampler import Argmax

logger = logging.getLogger(__name__)

# op class -> (its CPU version, the kernel library it needs); the GEMM needs none of its
# own: PackedGemm falls back to oneDNN or F.linear per weight.
_OPS = {
    RMSNorm: ("rms_norm_forward", "norm_rope"),
    ApplyRotaryEmb: ("rope_forward", "norm_rope"),
    SiluAndMul: ("silu_and_mul_forward", "activation"),
    Argmax: ("argmax_forward", "argmax"),
}


class CpuPlatform(Platform):
    name = "cpu"

    def default_attention_backend(self) -> str:
        if self.enforce_eager:
            return "torch"
        reason = kernels.status("paged_attention")
        if reason is None:
            return "cpu"
        logger.warning("attention_backend='auto': using 'torch', because the CPU kernel is not "
                       "usable here: %s", reason)
        return "torch"

    def check_attention_backend(self, name: str) -> None:
        if name == "cpu" and self.enforce_eager:
            raise ValueError("attention_backend='cpu' runs compiled C++ kernels, which "
                             "enforce_eager=True turns off: choose attention_backend='torch' "
                             "(or 'auto'), or drop enforce_eager")

    def op_version(self, op: CustomOp) -> Callable | None:
        if isinstance(op, Linear):
            return PackedLinear(op)
        for cls, (version, library) in _OPS.items():
            if isinstance(op, cls):
                if kernels.status(library) is not None:
                    return None
                return functools.partial(getattr(ops, version), op)
        return None

    def decode_step_runner(self, model: nn.Module, **limits) -> Callable | None:
        if self.enforce_eager:
            return None
        reason = decode_fast_path.unsupported_reason(model)
        if reason is not None:
            logger.debug("decode fast path off: %s", reason)
            return None
        return decode_fast_path.DecodeFastPath(model)
