"""C++ kernels for the model's layers on CPUs, each built on first use and called with ctypes.

    amx_linear.cpp     bfloat16 projections on Intel AMX tiles        wrapper: amx.py
    avx512_linear.cpp  float32 projections at decode sizes, AVX-512   wrapper: avx512.py
    norm_rope.cpp      RMSNorm (+ residual add) and rotary embedding  wrapper: norm_rope.py
    activation.cpp     the MLP's silu(gate) * up                      wrapper: activation.py

``PackedGemm`` (layers/linear.py) routes each projection to a GEMM kernel or to oneDNN by
dtype and row count; ``RMSNorm``, ``rotate`` and ``silu_and_mul`` call the others. Each
``*_status()`` is None where its kernel works here, else the reason it does not, and
each caller falls back then to torch code with the same results up to float rounding.
"""

from microvllm.layers.cpu_kernels.activation import (activation_applies, activation_status,
                                                     load_activation, silu_and_mul)
from microvllm.layers.cpu_kernels.amx import (amx_linear, amx_pack_weight, amx_status,
                                              amx_supports, load_amx)
from microvllm.layers.cpu_kernels.avx512 import (avx512_linear, avx512_pack_weight,
                                                 avx512_status, avx512_supports, load_avx512)
from microvllm.layers.cpu_kernels.norm_rope import (NORM_ROPE_DTYPES, load_norm_rope,
                                                    norm_rope_applies, norm_rope_status,
                                                    rms_norm, rope)

__all__ = ["activation_applies", "activation_status", "load_activation", "silu_and_mul",
           "amx_linear", "amx_pack_weight", "amx_status", "amx_supports", "load_amx",
           "avx512_linear", "avx512_pack_weight", "avx512_status", "avx512_supports",
           "load_avx512", "NORM_ROPE_DTYPES", "load_norm_rope", "norm_rope_applies",
           "norm_rope_status", "rms_norm", "rope"]
