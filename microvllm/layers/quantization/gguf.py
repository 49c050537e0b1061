"""GGUF's weight formats, kept as they are stored (vLLM: ``quantization/gguf.py``).

A GGUF file (llama.cpp's format) stores each matrix row by row, each row cut into blocks
of 32 weights along the input dimension; a block is its scale(s) then its quantized
values. The formats microvllm computes on::

    Q4_1   20 bytes = 32 weights, 4.0 + 1.0 bits each (5 bits per weight)
           ┌────────┬────────┬─────────────────────────────────────────┐
           │ d fp16 │ m fp16 │ qs: 16 bytes, two 4-bit values per byte │
           └────────┴────────┴─────────────────────────────────────────┘
             bytes 0-1  2-3      byte 4+j: low nibble = q[j], high nibble = q[j+16]
           w[i] = d * q[i] + m          q[i] in 0..15  (m: the block's minimum)

    Q8_0   34 bytes = 32 weights (8.5 bits per weight)
           ┌────────┬──────────────────────────────┐
           │ d fp16 │ qs: 32 int8                  │    w[i] = d * q[i]
           └────────┴──────────────────────────────┘

    F16    2 bytes per weight;   F32: 4 bytes (microvllm loads F32 matrices as plain floats)

So a ``[N, K]`` matrix is ``N`` rows of ``K / 32`` blocks: here a ``torch.uint8`` tensor
``[N, K / 32 * bytes_per_block]``, the file's bytes unchanged (the weight loaders copy and
slice whole rows, as they do for float weights). ``dequantize`` turns it back into floats
in plain torch: what ``LLM(enforce_eager=True)`` runs before ``F.linear``, and the same
float32 values the ``gguf`` package's numpy code (and so transformers) computes.

llama.cpp has many more formats (the k-quants Q4_K, Q6_K, ... with super-blocks of 256,
the i-quants); a file using them is refused with what to do instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from microvllm.layers.quantization.base_config import (
    EmbeddingMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    replace_weight,
)

BLOCK = 32   # weights per block in every format here


@dataclass(frozen=True)
class GGUFType:
    name: str
    block_size: int       # weights per block
    block_bytes: int      # bytes per block

    def row_bytes(self, in_features: int) -> int:
        if in_features % self.block_size:
            raise ValueError(f"{self.name} stores rows in blocks of {self.block_size} weights, but a row "
                             f"has {in_features}")
        return in_features // self.block_size * self.block_bytes


GGUF_TYPES = {t.name: t for t in (GGUFType("Q4_1", BLOCK, 20), GGUFType("Q8_0", BLOCK, 34),
                                  GGUFType("F16", 1, 2))}
# What a weight of these types becomes: float32 (no method).
FLOAT_TYPES = ("F32",)


def dequantize_q4_1(rows: torch.Tensor, in_features: int, block_size: int = BLOCK) -> torch.Tensor:
    """``uint8 [N, K/B * (4 + B/2)]`` -> ``float32 [N, K]``: ``w = d * q + m`` per block of
    ``B = block_size`` weights (32 in a GGUF file; ``quantize_q4_1`` writes other sizes too).
    Byte ``4 + j`` of a block holds ``q[j]`` in its low nibble and ``q[j + B/2]`` in its high."""
    blocks = rows.reshape(rows.shape[0], in_features // block_size, 4 + block_size // 2)
    ### BEGIN SOLUTION
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()      # [N, blocks, 1]
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    qs = blocks[..., 4:]                                                # [N, blocks, B/2]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()                 # q[0..B/2-1], then q[B/2..B-1]
    weights = d * q + m
    ### END SOLUTION
    return weights.reshape(rows.shape[0], in_features)


def quantize_q4_1(weight: torch.Tensor, block_size: int = BLOCK) -> torch.Tensor:
    """``float [N, K]`` -> ``uint8 [N, K/B * (4 + B/2)]``, the layout above, by round to nearest
    (llama.cpp's ``quantize_row_q4_1_ref``): per block of ``B = block_size`` weights,
    ``m = min``, ``d = (max - min) / 15``, ``q = round((w - m) / d)`` in 0..15 (an all-equal
    block: d = 0, every q = 0). With ``B = 32`` these are the bytes a GGUF file holds;
    ``dequantize_q4_1(quantize_q4_1(W, B), K, B)`` is the Q4_1 model at block size B."""
    rows, in_features = weight.shape
    if in_features % block_size or block_size % 2:
        raise ValueError(f"a row of {in_features} weights does not split into blocks of {block_size}")
    blocks = weight.detach().float().reshape(rows, in_features // block_size, block_size)
    ### BEGIN SOLUTION
    low = blocks.amin(dim=-1, keepdim=True)
    d = (blocks.amax(dim=-1, keepdim=True) - low) / 15
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.trunc((blocks - low) * inverse + 0.5).clamp_(0, 15).to(torch.uint8)   # round half up
    half = block_size // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    scales = torch.cat([d.half(), low.half()], dim=-1).view(torch.uint8)          # d, m: 2 bytes each
    stored = torch.cat([scales, packed], dim=-1)
    ### END SOLUTION
    return stored.reshape(rows, -1)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """``float [N, K]`` -> ``uint8 [N, K/32 * 34]``: per block, ``d = max|w| / 127``,
    ``q = round(w / d)`` (llama.cpp's ``quantize_row_q8_0_ref``)."""
    rows, in_features = weight.shape
    blocks = weight.detach().float().reshape(rows, in_features // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse).to(torch.int8)
    return torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(rows, -1)


def dequantize_q8_0(rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """``uint8 [N, K/32 * 34]`` -> ``float32 [N, K]``: ``w = d * q`` per block."""
    blocks = rows.reshape(rows.shape[0], in_features // BLOCK, 34)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (d * q).reshape(rows.shape[0], in_features)


def dequantize_f16(rows: torch.Tensor, in_features: int) -> torch.Tensor:
    return rows.contiguous().view(torch.float16).float().reshape(rows.shape[0], in_features)


DEQUANTIZE = {"Q4_1": dequantize_q4_1, "Q8_0": dequantize_q8_0, "F16": dequantize_f16}


def dequantize(rows: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
    """Rows of a GGUF matrix of type ``type_name`` -> float32 ``[rows, in_features]``."""
    return DEQUANTIZE[type_name](rows, in_features)


class GGUFLinearMethod(LinearMethodBase):
    """A ``Linear`` whose weight stays in a GGUF format: ``weight`` is ``uint8
    [out_features, row_bytes]``; ``apply`` dequantizes it, then ``F.linear``."""

    def __init__(self, type_name: str):
        self.type = GGUF_TYPES[type_name]

    def create_weights(self, layer: nn.Module) -> None:
        rows, in_features = layer.weight.shape
        replace_weight(layer, torch.empty(rows, self.type.row_bytes(in_features), dtype=torch.uint8))
        layer.weight_type = self.type.name

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return dequantize(layer.weight, self.type.name, layer.in_features)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dequantize(layer).to(x.dtype), bias)

    def __repr__(self) -> str:
        return f"GGUFLinearMethod({self.type.name})"


class GGUFEmbeddingMethod(EmbeddingMethodBase):
    """The token embedding in a GGUF format: only the looked-up rows are dequantized, to
    ``dtype`` (the model's activations)."""

    def __init__(self, type_name: str, dtype: torch.dtype = torch.float32):
        self.type, self.dtype = GGUF_TYPES[type_name], dtype

    def create_weights(self, layer: nn.Module) -> None:
        rows, dim = layer.weight.shape
        replace_weight(layer, torch.empty(rows, self.type.row_bytes(dim), dtype=torch.uint8))
        layer.weight_type = self.type.name

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return dequantize(layer.weight[input_ids], self.type.name, layer.embedding_dim).to(self.dtype)

    def __repr__(self) -> str:
        return f"GGUFEmbeddingMethod({self.type.name})"


class GGUFConfig(QuantizationConfig):
    """The formats a GGUF file stores, layer by layer: ``tensor_types`` maps a layer's name
    in the model (``layers.0.mlp.down_proj``, ``embed_tokens``, ``lm_head``) to its GGUF
    type; the GGUF loader (``models/gguf_loader.py``) reads it from the file."""

    def __init__(self, tensor_types: dict[str, str], dtype: torch.dtype = torch.float32):
        self.tensor_types = dict(tensor_types)
        self.dtype = dtype   # what embeddings are dequantized to (the model's activations)

    @classmethod
    def get_name(cls) -> str:
        return "gguf"

    def get_quant_method(self, layer: nn.Module, prefix: str):
        from microvllm.layers.vocab_parallel_embedding import VocabParallelEmbedding

        type_name = self.tensor_types.get(prefix)
        if type_name is None or type_name in FLOAT_TYPES:
            return None
        if isinstance(layer, VocabParallelEmbedding):
            return GGUFEmbeddingMethod(type_name, self.dtype)
        return GGUFLinearMethod(type_name)
