"""The model's projections: ``y = x @ W.T + b``, as ``nn.Linear`` (same parameters, same
checkpoint names)::

    x [T, in_features] ──> y [T, out_features]      W: weight [out_features, in_features]

A ``CustomOp``: ``forward_native`` is ``F.linear``. A platform may multiply with its own
GEMM instead, from a copy of ``W`` it prepared once after loading: on a CPU the
weight is packed into the layout its kernels read (vLLM's
``dispatch_cpu_unquantized_gemm`` does the same; see ``platforms/cpu/gemm.py`` and
notebook 11). Either way the result is ``x @ W.T + b`` up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from microvllm.layers.custom_op import CustomOp


class Linear(CustomOp):
    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.register_parameter("bias", nn.Parameter(torch.zeros(out_features)) if bias else None)
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)   # as nn.Linear; a checkpoint overwrites it

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
