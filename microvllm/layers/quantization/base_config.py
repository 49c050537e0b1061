"""What every quantization format provides (vLLM: ``model_executor/layers/quantization/base_config.py``).

    QuantizationConfig        one per format ("gguf", "int8"): read from the checkpoint or
                              asked for by name, it hands each layer its method
        get_quant_method(layer, prefix) -> a method object, or None (the layer stays float)
    LinearMethodBase          one per format: how a ``Linear`` stores and multiplies
        create_weights(layer)       replace ``layer.weight`` by the format's tensors
        apply(layer, x, bias)       ``x @ W.T + bias`` from those tensors, in plain torch
    EmbeddingMethodBase       the same for the token embedding (a GGUF file quantizes it)
        embedding(layer, ids)       the rows of ``W`` for ``ids``, dequantized

The model file never learns about any of this: after the model is built (on the meta
device, before any weight is read), ``quantize_layers`` walks its ``Linear`` and
embedding layers and hands each one its method (gpt-fast's ``quantize.py`` swaps modules
the same way; vLLM passes ``quant_config`` down to every layer's constructor). A layer
with a method runs ``method.apply`` in its ``forward_native``; the platform may bind a
faster version of the same math afterwards (``platforms/cpu/quantized_gemm.py``).

A quantized weight keeps the name ``weight`` (so checkpoint names, weight loaders and
tied embeddings work unchanged) but holds the format's bytes: ``torch.uint8`` or
``torch.int8``, which ``model.to(dtype)`` leaves alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class QuantizeMethodBase(ABC):
    """How one layer stores its weight in a format."""

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Replace ``layer.weight`` by this format's (empty) tensors; the loader fills them."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Anything to do once the checkpoint is read (quantize a float weight, for int8)."""


class LinearMethodBase(QuantizeMethodBase):
    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., in_features] @ W.T + bias`` -> ``[..., out_features]``, in plain torch."""

    @abstractmethod
    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The whole weight as float32 ``[out_features, in_features]``."""


class EmbeddingMethodBase(QuantizeMethodBase):
    @abstractmethod
    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]`` -> their rows of the weight, dequantized to the model's dtype,
        ``[T, embedding_dim]``."""


class QuantizationConfig(ABC):
    """A format, and which layers use it (vLLM's ``QuantizationConfig``)."""

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The name ``LLM(quantization=...)`` takes."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for ``layer`` (named ``prefix`` in the model, e.g.
        ``layers.0.self_attn.qkv_proj``), or None to keep it in float."""

    def process_weights_after_loading(self, model: nn.Module) -> None:
        """Let every layer's method finish its weights once the checkpoint is read."""
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)


def quantize_layers(model: nn.Module, config: QuantizationConfig) -> None:
    """Give every ``Linear`` and token embedding of ``model`` its method from ``config``
    (built on the meta device: nothing is allocated yet)."""
    from microvllm.layers.linear import Linear
    from microvllm.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for prefix, layer in model.named_modules():
        if isinstance(layer, (Linear, VocabParallelEmbedding)):
            method = config.get_quant_method(layer, prefix)
            if method is not None:
                layer.quant_method = method
                method.create_weights(layer)


def replace_weight(layer: nn.Module, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in ``layer.weight``'s place, keeping its ``weight_loader``."""
    loader = getattr(layer.weight, "weight_loader", None)
    layer.weight = nn.Parameter(tensor, requires_grad=False)
    if loader is not None:
        layer.weight.weight_loader = loader
