"""SiLU-gated MLP activation: the gate and up projections are one fused matmul whose
output ``[T, 2 * intermediate]`` is split in half here.

On a CPU this is one C++ pass (``layers/cpu_kernels/activation.cpp``, vLLM's
``silu_and_mul``) that rounds where the torch code below rounds; elsewhere, or without
a compiler, the torch code runs."""

import torch
import torch.nn.functional as F

from microvllm.layers import cpu_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if cpu_kernels.activation_applies(gate_up):
        return cpu_kernels.silu_and_mul(gate_up)
    return silu_and_mul_native(gate_up)


def silu_and_mul_native(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch code: two operators, ``F.silu(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
