"""``ModelConfig``: which weights, read how (vLLM: ``vllm/config/model.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype) -> torch.dtype:
    """``"bfloat16"`` (or ``torch.bfloat16``) -> ``torch.bfloat16``; anything else not in
    ``DTYPES`` is refused."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def is_hybrid(hf_config) -> bool:
    """Whether ``hf_config`` (a config.json) is a hybrid: linear-attention layers, whose
    memory is a state, beside attention ones (Qwen3.5). Hugging Face writes it in the
    config's ``layer_types``, so the config decides, and only here: the engine's arguments
    (a larger block size, what a hybrid cannot do) and the KV cache layout both ask."""
    return "linear_attention" in (getattr(hf_config, "layer_types", None) or ())


@dataclass(frozen=True)
class ModelConfig:
    """The model, once its folder is found and its config.json read.

    model              what the user named (a folder, a cached hub id, or None: the
                       embedded default model)
    model_path         the folder it resolved to (config.json, *.safetensors, tokenizer)
    hf_config          its config.json, as transformers reads it
    dtype              "float32", "float16" or "bfloat16" ("auto" is settled by then)
    seed               seed of the sampling generator shared by requests without their own
    generation_config  where ``get_default_sampling_params()`` reads defaults: "auto" (the
                       model's generation_config.json), "vllm" (plain ``SamplingParams()``)
                       or a folder
    max_logprobs       the most logprobs / prompt_logprobs one request may ask for (-1:
                       up to the vocabulary)
    quantization       how the weights are stored: None (the checkpoint's floats), "gguf"
                       (a GGUF file's own formats) or "int8" (layers/quantization/)
    """

    model: str | None
    model_path: Path
    hf_config: Any = field(repr=False)
    dtype: str
    seed: int = 0
    generation_config: str = "auto"
    max_logprobs: int = 20
    quantization: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)
