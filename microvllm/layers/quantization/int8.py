"""int8 weight-only quantization of any float checkpoint, per output channel (vLLM's
closest names: ``quantization="experts_int8"`` / ``"fbgemm_fp8"`` are weight-only the
same way; gpt-fast's ``WeightOnlyInt8QuantHandler`` is this exact scheme)::

    W [N, K] float  ──>  weight int8 [N, K]   q[n, k] = round(W[n, k] / s[n]),  |q| <= 127
                         weight_scale [N]     s[n] = max_k |W[n, k]| / 127   (one per row)
    W ≈ q * s[:, None]          y = x @ (q * s).T + bias

One scale per output row: the row's largest weight maps to ±127, so each row keeps about
7 bits of its own range (a row of small weights is not crushed by another's large ones).
Activations stay in float ("weight-only"): the weights' bytes halve against bfloat16 and
quarter against float32, which is what a memory-bound decode step pays for.

The checkpoint is read in float as usual, then each layer is quantized in
``process_weights_after_loading`` and its float weight dropped. The token embedding is
quantized by rows too (a row is a token), so a tied LM head shares it as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from microvllm.layers.quantization.base_config import (
    EmbeddingMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    replace_weight,
)


def quantize_int8_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``float [N, K]`` -> ``(int8 [N, K], float32 scales [N])`` (see the module doc)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))   # an all-zero row
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``int8 [N, K]``, ``scales [N]`` -> ``float32 [N, K]``."""
    return weight.float() * scale[:, None]


class _Int8Weights:
    """Quantizes a layer's float weight once; a weight shared by two layers (a tied
    embedding and LM head) is quantized once and stays shared."""

    done: dict[int, tuple[nn.Parameter, torch.Tensor]]

    def create_weights(self, layer: nn.Module) -> None:
        """Nothing yet: the checkpoint is read into the float weight first."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight.dtype == torch.int8:
            return
        key = id(layer.weight)
        if key not in self.done:
            q, scale = quantize_int8_per_row(layer.weight)
            replace_weight(layer, q)
            self.done[key] = (layer.weight, scale)
        layer.weight, scale = self.done[key]
        layer.register_buffer("weight_scale", scale, persistent=False)


class Int8LinearMethod(_Int8Weights, LinearMethodBase):
    def __init__(self, done: dict):
        self.done = done

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_int8(layer.weight, layer.weight_scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dequantize(layer).to(x.dtype), bias)

    def __repr__(self) -> str:
        return "Int8LinearMethod(per-row scales)"


class Int8EmbeddingMethod(_Int8Weights, EmbeddingMethodBase):
    def __init__(self, done: dict, dtype: torch.dtype):
        self.done, self.dtype = done, dtype

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return dequantize_int8(layer.weight[input_ids], layer.weight_scale[input_ids]).to(self.dtype)

    def __repr__(self) -> str:
        return "Int8EmbeddingMethod(per-row scales)"


class Int8Config(QuantizationConfig):
    """``LLM(model=<folder>, quantization="int8")``: every ``Linear`` and the token
    embedding in int8 with per-row scales."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.done: dict = {}

    @classmethod
    def get_name(cls) -> str:
        return "int8"

    def get_quant_method(self, layer: nn.Module, prefix: str):
        from microvllm.layers.vocab_parallel_embedding import VocabParallelEmbedding

        if isinstance(layer, VocabParallelEmbedding):
            return Int8EmbeddingMethod(self.done, self.dtype)
        return Int8LinearMethod(self.done)

    def process_weights_after_loading(self, model: nn.Module) -> None:
        super().process_weights_after_loading(model)
        self.done.clear()   # drop the references to the float weights
        release_freed_memory()


def release_freed_memory() -> None:
    """Hand the float weights' freed memory back to the operating system. glibc keeps freed
    heap memory for reuse, so without this the process would stay as large as the float model
    (measured: ~430 MB of the embedded model's 515 MB). Nothing to do off glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
