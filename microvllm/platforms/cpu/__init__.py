"""The CPU platform: C++ kernels for the model's ops, packed GEMMs, a C++ attention
backend and a decode fast path, each used only where it builds and applies here.

    op / step                 CPU version                              file
    Linear                    packed GEMM: AVX-512 / AMX / oneDNN      gemm.py, gemm_kernels.py
    RMSNorm, ApplyRotaryEmb,  one C++ pass each                        ops.py
      SiluAndMul, Argmax
    attention ("auto")        paged decode + prefill kernels           attention_backend.py
    a decode-only step        every layer in one C call                decode_fast_path.py
    building and loading      csrc/*.cpp, signatures from csrc/ops.h   kernels.py

Every version computes what the op's ``forward_native`` computes (tests compare them),
and a kernel that does not build here (no compiler, an older CPU) leaves its op on
``forward_native``. With ``enforce_eager=True`` nothing here is loaded.
"""

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
        from microvllm.platforms.cpu import kernels
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
        from microvllm.platforms.cpu import kernels, ops
        if isinstance(op, Linear):
            from microvllm.platforms.cpu.gemm import PackedLinear
            return PackedLinear(op)
        for cls, (version, library) in _OPS.items():
            if isinstance(op, cls):
                if kernels.status(library) is not None:
                    return None
                return functools.partial(getattr(ops, version), op)
        return None

    def decode_step_runner(self, model: nn.Module) -> Callable | None:
        if self.enforce_eager:
            return None
        from microvllm.platforms.cpu import decode_fast_path
        reason = decode_fast_path.unsupported_reason(model)
        if reason is not None:
            logger.debug("decode fast path off: %s", reason)
            return None
        return decode_fast_path.DecodeFastPath(model)
