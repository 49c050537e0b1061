"""SiLU-gated MLP activation: the gate and up projections are one fused matmul whose
output ``[T, 2 * intermediate]`` is split in half here::

    gate_up [T, 2I] = [ gate | up ]  ──>  silu(gate) * up  [T, I]

A ``CustomOp`` (vLLM's ``SiluAndMul``): a platform may run it as one pass (the CPU
platform's kernel rounds where these two torch operators round)."""

import torch
import torch.nn.functional as F

from microvllm.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
