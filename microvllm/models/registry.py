"""Model classes keyed by the ``architectures`` entry of config.json."""

from __future__ import annotations

from microvllm.models.llama import LlamaForCausalLM
from microvllm.models.mistral import MistralForCausalLM
from microvllm.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def resolve_model_class(config, where: str = "config.json"):
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"{where}: architectures={architectures} is not supported; "
                     f"microvllm runs {sorted(MODEL_REGISTRY)}")
