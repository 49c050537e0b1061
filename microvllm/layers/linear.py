"""The model's projections: ``y = x @ W.T + b``, as ``nn.Linear`` (same parameters, same
checkpoint names)::

    x [T, in_features] ──> y [T, out_features]      W: weight [out_features, in_features]

A ``CustomOp``: ``forward_native`` is ``F.linear``; with quantized weights
(``layers/quantization/``) it is the format's ``quant_method.apply``, which dequantizes
and calls ``F.linear``. A platform may multiply with its own
GEMM instead, from a copy of ``W`` it prepared once after loading: on a CPU the
weight is packed into the layout its kernels read (vLLM's
``dispatch_cpu_unquantized_gemm`` does the same; see ``platforms/cpu/gemm.py`` and
notebook 11). Either way the result is ``x @ W.T + b`` up to float rounding.

Below ``Linear``: the tensor-parallel versions (``ColumnParallelLinear``,
``MergedColumnParallelLinear``, ``QKVParallelLinear``, ``RowParallelLinear``), each a
``Linear`` over one rank's shard of the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from microvllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from microvllm.layers.custom_op import CustomOp


class Linear(CustomOp):
    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.register_parameter("bias", nn.Parameter(torch.zeros(out_features)) if bias else None)
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)   # as nn.Linear; a checkpoint overwrites it
        self.quant_method = None   # a LinearMethodBase when the weight is quantized

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        text = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        return text + (f", quant_method={self.quant_method}" if self.quant_method is not None else "")


# ------------------------------------------------------------------ tensor parallelism
# vLLM's parallel linear layers (``vllm/model_executor/layers/linear.py``). Each is a
# ``Linear`` over this rank's shard of the weight, so the platform's GEMM (packed weights on
# a CPU) runs each shard exactly as it runs a whole weight, and ``enforce_eager=True`` runs
# ``F.linear``. With one rank (``tensor_parallel_size=1``) each shard is the whole weight and
# nothing is communicated: the model reads the same either way.
#
# A Llama layer uses them in pairs, so that one all-reduce per pair is all it takes
# (Megatron-LM's scheme)::
#
#    x [T, hidden] (every rank)             x [T, hidden] (every rank)
#       │ QKVParallelLinear: my heads          │ MergedColumnParallelLinear: my slice of gate, up
#    q,k,v of my heads ─> attention          silu(gate) * up  [T, intermediate / tp]
#       │ RowParallelLinear: my columns        │ RowParallelLinear: my columns
#    partial [T, hidden] ── all-reduce ──>   partial [T, hidden] ── all-reduce ──> h (every rank)
#
# The loader gives each rank its shard by calling the parameter's ``weight_loader`` (set
# here, as vLLM sets it) with the whole checkpoint tensor; the layer cuts out its part.


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}: "
                         f"choose a tensor_parallel_size that divides {numerator}")
    return numerator // denominator


def check_shape(loaded_weight: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Raise if a checkpoint tensor is not the size config.json implies (the loader adds
    the file and the tensor's name to the message)."""
    if tuple(loaded_weight.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(loaded_weight.shape)} but config.json implies {tuple(expected)}")


def shard_heads(total_num_heads: int, total_num_kv_heads: int, tp_size: int) -> tuple[int, int, int]:
    """How ``tp_size`` ranks split attention heads: ``(query heads per rank, KV heads per
    rank, ranks that hold a copy of each KV head)``. Query heads split evenly; KV heads
    split evenly too, or, when there are fewer KV heads than ranks, each is copied onto
    ``tp_size // total_num_kv_heads`` ranks (as vLLM does)::

        9 query heads, 3 KV heads, tp=3:  rank r: query heads 3r..3r+2, KV head r
        4 query heads, 2 KV heads, tp=4:  rank r: query head r, KV head r // 2 (2 copies)

    Raises ValueError naming both numbers when they do not divide."""
    def sizes_that_work():
        return [n for n in range(1, total_num_heads + 1) if total_num_heads % n == 0 and
                (total_num_kv_heads % n == 0 if n <= total_num_kv_heads else n % total_num_kv_heads == 0)]

    if total_num_heads % tp_size:
        raise ValueError(f"num_attention_heads={total_num_heads} is not divisible by tensor_parallel_size="
                         f"{tp_size}: each rank computes an equal share of the query heads. Choose "
                         f"tensor_parallel_size from {sizes_that_work()}")
    if total_num_kv_heads >= tp_size and total_num_kv_heads % tp_size:
        raise ValueError(f"num_key_value_heads={total_num_kv_heads} is not divisible by tensor_parallel_size="
                         f"{tp_size}: each rank holds an equal share of the KV heads. Choose "
                         f"tensor_parallel_size from {sizes_that_work()}")
    if total_num_kv_heads < tp_size and tp_size % total_num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp_size} is not a multiple of num_key_value_heads="
                         f"{total_num_kv_heads}: with fewer KV heads than ranks each KV head is copied "
                         f"onto an equal number of ranks. Choose tensor_parallel_size from "
                         f"{sizes_that_work()}")
    replicas = max(1, tp_size // total_num_kv_heads)
    return total_num_heads // tp_size, max(1, total_num_kv_heads // tp_size), replicas


class ColumnParallelLinear(Linear):
    """``y = x @ W.T`` with ``W``'s rows (output features) split across ranks::

        W [output_size, input_size]   rank r holds rows r*n .. (r+1)*n,  n = output_size / tp
        x [T, input_size] (whole, every rank) ──> y_r [T, n]   (this rank's columns of y)

    ``gather_output=True`` all-gathers the ``y_r`` into ``y [T, output_size]`` on every
    rank; the model's layers never need it (a ``RowParallelLinear`` takes ``y_r`` as is)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False):
        self.tp_rank, self.tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.input_size, self.output_size, self.gather_output = input_size, output_size, gather_output
        super().__init__(input_size, divide(output_size, self.tp_size, "output_size"), bias)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the whole checkpoint tensor into ``param``."""
        n = param.shape[0]
        check_shape(loaded_weight, (n * self.tp_size, *param.shape[1:]))
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return tensor_model_parallel_all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (Llama's
    ``gate_proj`` and ``up_proj``); each is split across ranks on its own, so that every
    rank holds matching slices of all of them::

        checkpoint: gate [I, hidden], up [I, hidden]          (I = intermediate_size)
        rank r's weight [2 I / tp, hidden] = [ gate rows r*I/tp.. | up rows r*I/tp.. ]

    (Splitting the fused ``[2 I, hidden]`` weight in halves instead would give rank 0 all
    of gate and rank 1 all of up: ``silu(gate) * up`` would then need both.)"""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True):
        self.output_sizes = list(output_sizes)
        tp_size = get_tensor_model_parallel_world_size()
        for size in self.output_sizes:
            divide(size, tp_size, "intermediate_size")
        super().__init__(input_size, sum(self.output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | None = None) -> None:
        """Checkpoint tensor number ``loaded_shard_id`` (0: gate, 1: up) -> its slice of
        this rank's fused weight."""
        if loaded_shard_id is None:
            raise ValueError("is a fused weight: the checkpoint must store its parts separately")
        full = self.output_sizes[loaded_shard_id]
        check_shape(loaded_weight, (full, *param.shape[1:]))
        n, offset = full // self.tp_size, sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        param.data[offset:offset + n].copy_(loaded_weight.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections in one matmul, split across ranks by heads::

        rank r's weight [(heads + 2 kv_heads) * head_size, hidden]
            rows 0 .. heads*d            q: query heads  r*heads .. (r+1)*heads
            rows .. + kv_heads*d         k: KV heads of this rank (see ``shard_heads``)
            rows .. + kv_heads*d         v: the same KV heads

    so attention runs on each rank over its own heads, with no communication, and each
    rank's KV cache holds only its KV heads. ``self.num_heads``, ``self.num_kv_heads``:
    per rank."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False):
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads, self.num_kv_heads, self.num_kv_head_replicas = shard_heads(
            total_num_heads, total_num_kv_heads, tp_size)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: str | None = None) -> None:
        """Checkpoint tensor ``q_proj``, ``k_proj`` or ``v_proj`` (``loaded_shard_id`` "q",
        "k", "v") -> this rank's heads of it, in their rows of the fused weight."""
        d = self.head_size
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if loaded_shard_id == "q":
            offset, n, total, shard_rank = 0, q_size, self.total_num_heads * d, self.tp_rank
        elif loaded_shard_id in ("k", "v"):
            offset = q_size if loaded_shard_id == "k" else q_size + kv_size
            # copies of one KV head sit on consecutive ranks
            n, total = kv_size, self.total_num_kv_heads * d
            shard_rank = self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError("is a fused weight: the checkpoint must store q, k and v separately")
        check_shape(loaded_weight, (total, *param.shape[1:]))
        param.data[offset:offset + n].copy_(loaded_weight.narrow(0, shard_rank * n, n))


class RowParallelLinear(Linear):
    """``y = x @ W.T + b`` with ``W``'s columns (input features) split across ranks, the
    input already split the same way (a column-parallel layer's output)::

        W [output_size, input_size]   rank r holds columns r*n .. (r+1)*n,  n = input_size / tp
        x_r [T, n] ──> x_r @ W_r.T = partial_r [T, output_size] ── all-reduce ──> y (every rank)

    since ``x @ W.T = sum over r of x_r @ W_r.T``. The bias is added once: rank 0 holds it,
    every other rank holds zeros, so the sum counts it once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True):
        self.tp_rank, self.tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        super().__init__(divide(input_size, self.tp_size, "input_size"), output_size, bias)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias
            check_shape(loaded_weight, param.shape)
            param.data.copy_(loaded_weight if self.tp_rank == 0 else torch.zeros_like(loaded_weight))
            return
        n = param.shape[1]
        check_shape(loaded_weight, (param.shape[0], n * self.tp_size))
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(super().forward(x))
