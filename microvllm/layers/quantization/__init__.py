"""Quantized weights (vLLM: ``vllm/model_executor/layers/quantization/``).

    name      config (a QuantizationConfig)   what it stores                       file
    "gguf"    GGUFConfig                      a GGUF file's Q4_1 / Q8_0 / F16 blocks  gguf.py
    "int8"    Int8Config                      int8 weights, one scale per row        int8.py

``LLM(model="<file>.gguf")`` chooses "gguf" by itself (as vLLM does);
``LLM(model=<folder>, quantization="int8")`` quantizes a float checkpoint as it loads.
``base_config.py`` has the two interfaces (``QuantizationConfig``, ``LinearMethodBase``)
and how they enter the model; notebook 16 walks through it.
"""

from __future__ import annotations

from microvllm.layers.quantization.base_config import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    quantize_layers,
)

QUANTIZATION_METHODS = ("gguf", "int8")


def check_quantization(name: str | None, is_gguf: bool) -> str | None:
    """The quantization a model runs with: ``name`` checked against the model (a GGUF file
    is always "gguf"); raises ValueError saying what to change."""
    if name is not None and name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={name!r} is not supported: choose one of {list(QUANTIZATION_METHODS)} "
                         "(or None for the checkpoint's own weights)")
    if is_gguf:
        if name not in (None, "gguf"):
            raise ValueError(f"quantization={name!r} with a GGUF file: a GGUF file keeps its own formats; "
                             "drop quantization= (or pass quantization='gguf')")
        return "gguf"
    if name == "gguf":
        raise ValueError("quantization='gguf' needs a .gguf file: pass model='path/to/file.gguf'")
    return name


__all__ = ["LinearMethodBase", "QUANTIZATION_METHODS", "QuantizationConfig", "QuantizeMethodBase",
           "check_quantization", "quantize_layers"]
