"""Model classes keyed by the ``architectures`` entry of config.json."""

from __future__ import annotations

from microvllm.models.llama import LlamaForCausalLM
from microvllm.models.mistral import MistralForCausalLM
from microvllm.models.mixtral import MixtralForCausalLM
from microvllm.models.qwen3 import Qwen3ForCausalLM
from microvllm.models.qwen3_5 import Qwen3_5ForCausalLM
from microvllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
}


def moe_dims(config):
    """``MoEDims`` (``qwen3_moe.py``) for a mixture-of-experts config.json, None for a dense model."""
    model_cls = resolve_model_class(config)
    return model_cls.moe_dims(config) if getattr(model_cls, "is_mixture_of_experts", False) else None


def resolve_model_class(config, where: str = "config.json"):
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"{where}: architectures={architectures} is not supported; "
                     f"microvllm runs {sorted(MODEL_REGISTRY)}")
