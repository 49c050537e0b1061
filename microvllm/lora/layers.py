"""The ``*WithLoRA`` wrappers: a linear layer plus every loaded adapter's low-rank update
(vLLM: ``vllm/lora/layers/``).

The base layer is kept untouched inside (its weights, quantized or packed, and its
platform GEMM); the wrapper adds, per token, the update of that token's adapter::

    y = base(x) + B_slot(t) @ A_slot(t) @ x        for each token t (nothing where slot is -1)

    lora_a_stacked[i]  [max_loras, max_lora_rank, in]        one per output slice i
    lora_b_stacked[i]  [max_loras, out_slice_i, max_lora_rank]
                        ^ slot                   ^ an adapter of rank r fills the first r, zeros after

The slices: one for a plain projection; q, k, v for ``qkv_proj``; gate, up for
``gate_up_proj`` (an adapter may target some and not others: the others stay zero). The
scaling (alpha / r) is folded into B when an adapter is copied in (as vLLM's
``LoRAModel.optimize`` does), so the step does two matmuls and nothing else.

Tensor parallelism: each rank holds its part of A and B, cut as its base weight is cut::

    column layers (qkv, gate_up)  W's rows split  ->  B's rows split, A whole
    row layers (o, down)          W's cols split  ->  A's cols split, B whole;
                                  the update joins the partial sum before the all-reduce
"""

from __future__ import annotations

import torch
from torch import nn

from microvllm.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from microvllm.layers.custom_op import CustomOp
from microvllm.layers.linear import (
    ColumnParallelLinear,
    Linear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from microvllm.lora.punica_wrapper import PunicaWrapperBase


class BaseLayerWithLoRA(CustomOp):
    """What every wrapper has: the base layer, the stacked slots, the slices."""

    def __init__(self, base_layer: Linear):
        super().__init__()
        self.base_layer = base_layer
        self.tp_rank: int = getattr(base_layer, "tp_rank", 0)
        self.tp_size: int = getattr(base_layer, "tp_size", 1)
        self.output_slices: tuple[int, ...] = (base_layer.out_features,)
        self.lora_a_stacked: tuple[torch.Tensor, ...] = ()
        self.lora_b_stacked: tuple[torch.Tensor, ...] = ()
        self.punica_wrapper: PunicaWrapperBase | None = None

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def create_lora_weights(self, max_loras: int, max_lora_rank: int, dtype: torch.dtype) -> None:
        device = self.base_layer.weight.device
        in_features = self.base_layer.in_features
        self.lora_a_stacked = tuple(torch.zeros(max_loras, max_lora_rank, in_features, dtype=dtype, device=device)
                                    for _ in self.output_slices)
        self.lora_b_stacked = tuple(torch.zeros(max_loras, size, max_lora_rank, dtype=dtype, device=device)
                                    for size in self.output_slices)

    def set_mapping(self, punica_wrapper: PunicaWrapperBase) -> None:
        self.punica_wrapper = punica_wrapper

    def reset_lora(self, index: int) -> None:
        for a, b in zip(self.lora_a_stacked, self.lora_b_stacked):
            a[index].zero_()
            b[index].zero_()

    def set_lora(self, index: int, lora_a: list[torch.Tensor | None], lora_b: list[torch.Tensor | None]) -> None:
        """Slot ``index`` <- one adapter: per slice the whole ``A [r, in]`` and ``B [out, r]``
        (B already scaled), or None where the adapter leaves the slice alone."""
        self.reset_lora(index)
        for i, (a, b) in enumerate(zip(lora_a, lora_b)):
            if a is None or b is None:
                continue
            a, b = self.slice_lora_a(a, i), self.slice_lora_b(b, i)
            r = a.shape[0]
            if a.shape[1] != self.lora_a_stacked[i].shape[2] or b.shape[0] != self.lora_b_stacked[i].shape[1]:
                raise ValueError(f"LoRA matrices A {tuple(a.shape)}, B {tuple(b.shape)} do not fit this layer "
                                 f"(in={self.lora_a_stacked[i].shape[2]}, out={self.lora_b_stacked[i].shape[1]}): "
                                 f"was the adapter trained on this base model?")
            self.lora_a_stacked[i][index, :r].copy_(a)
            self.lora_b_stacked[i][index, :, :r].copy_(b)

    # This rank's part of an adapter's matrices (whole on one rank): see the module docstring.
    def slice_lora_a(self, lora_a: torch.Tensor, slice_index: int) -> torch.Tensor:
        return lora_a

    def slice_lora_b(self, lora_b: torch.Tensor, slice_index: int) -> torch.Tensor:
        return lora_b

    def add_lora(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` (this rank's base output) plus each token's adapter update."""
        if self.punica_wrapper is None or self.punica_wrapper.num_tokens is None:
            return out
        y = out.reshape(-1, out.shape[-1])
        self.punica_wrapper.add_lora_linear(y, x.reshape(-1, x.shape[-1]), self.lora_a_stacked,
                                            self.lora_b_stacked, self.output_slices)
        return y.view(out.shape)

    def extra_repr(self) -> str:
        slots = self.lora_a_stacked[0].shape[:2] if self.lora_a_stacked else None
        return f"output_slices={self.output_slices}, (max_loras, max_lora_rank)={tuple(slots) if slots else None}"


class ColumnParallelLinearWithLoRA(BaseLayerWithLoRA):
    """Around a ``ColumnParallelLinear``: one slice, B cut by output rows."""

    def slice_lora_b(self, lora_b: torch.Tensor, slice_index: int) -> torch.Tensor:
        n = self.output_slices[slice_index]
        return lora_b.narrow(0, self.tp_rank * n, n)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        # The base layer's own version (the platform's GEMM, or F.linear), without its
        # communication: the update joins this rank's columns first.
        out = self.add_lora(self.base_layer.forward_method(x), x)
        return tensor_model_parallel_all_gather(out) if getattr(self.base_layer, "gather_output", False) else out


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """Around ``gate_up_proj``: two slices (gate, up), each cut by rows on its own."""

    def __init__(self, base_layer: MergedColumnParallelLinear):
        super().__init__(base_layer)
        self.output_slices = tuple(size // self.tp_size for size in base_layer.output_sizes)


class MergedQKVParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """Around ``qkv_proj`` with q, k and v adapted separately (what peft trains on a
    Hugging Face model): three slices, this rank's heads of each."""

    def __init__(self, base_layer: QKVParallelLinear):
        super().__init__(base_layer)
        d = base_layer.head_size
        self.output_slices = (base_layer.num_heads * d, base_layer.num_kv_heads * d, base_layer.num_kv_heads * d)
        # copies of one KV head sit on consecutive ranks (layers/linear.py, shard_heads)
        self.shard_ranks = (self.tp_rank, *(2 * [self.tp_rank // base_layer.num_kv_head_replicas]))

    def slice_lora_b(self, lora_b: torch.Tensor, slice_index: int) -> torch.Tensor:
        n = self.output_slices[slice_index]
        return lora_b.narrow(0, self.shard_ranks[slice_index] * n, n)


class RowParallelLinearWithLoRA(BaseLayerWithLoRA):
    """Around a ``RowParallelLinear``: A cut by input columns (as W is), B whole."""

    def slice_lora_a(self, lora_a: torch.Tensor, slice_index: int) -> torch.Tensor:
        n = self.base_layer.in_features
        return lora_a.narrow(1, self.tp_rank * n, n)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.add_lora(self.base_layer.forward_method(x), x)
        return tensor_model_parallel_all_reduce(partial)


def from_layer(layer: nn.Module) -> BaseLayerWithLoRA | None:
    """The wrapper for ``layer``, or None if LoRA cannot wrap it (vLLM: ``from_layer``,
    which asks each class's ``can_replace_layer``). Most specific class first."""
    if isinstance(layer, QKVParallelLinear):
        return MergedQKVParallelLinearWithLoRA(layer)
    if isinstance(layer, MergedColumnParallelLinear):
        return MergedColumnParallelLinearWithLoRA(layer)
    if isinstance(layer, ColumnParallelLinear):
        return ColumnParallelLinearWithLoRA(layer)
    if isinstance(layer, RowParallelLinear):
        return RowParallelLinearWithLoRA(layer)
    return None
