"""SiLU-gated MLP activation: the gate and up projections are one fused matmul whose
output ``[T, 2 * intermediate]`` is split in half here."""

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
