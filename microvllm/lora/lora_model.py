"""``LoRAModel``: one adapter, loaded from its peft folder (vLLM: ``vllm/lora/lora_model.py``).

peft names each tensor after the Hugging Face module it adapts::

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   [out, r]
    └── peft's wrapper ─┘└──── the module ──────────┘└─ which ─┘

and ``LoRAModel.loras`` keeps them by module name (``"layers.0.self_attn.q_proj"``:
the decoder's own names, as our model's modules are named), one ``LoRALayerWeights`` each.
The tensors stay on the CPU: the manager copies an adapter into a device slot when a
step needs it (``model_manager.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from microvllm.lora.lora_weights import LoRALayerWeights
from microvllm.lora.peft_helper import WEIGHTS_NAME, PEFTHelper

_PREFIXES = ("base_model.model.", "model.")


def parse_fine_tuned_lora_name(name: str) -> tuple[str, str]:
    """``"base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"`` -> ``("layers.0.mlp.up_proj", "lora_B")``."""
    parts = name.split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise ValueError(f"{WEIGHTS_NAME} holds {name!r}, which is not a LoRA matrix (…lora_A.weight or "
                         f"…lora_B.weight): only plain LoRA adapters are supported")
    module = ".".join(parts[:-2])
    for prefix in _PREFIXES:
        if module.startswith(prefix):
            module = module[len(prefix):]
    return module, parts[-2]


@dataclass
class LoRAModel:
    id: int                              # the request's lora_int_id
    rank: int
    loras: dict[str, LoRALayerWeights]   # module name -> its matrices

    def get_lora(self, module_name: str) -> LoRALayerWeights | None:
        return self.loras.get(module_name)

    @classmethod
    def from_local_checkpoint(cls, lora_dir: str | Path, peft_helper: PEFTHelper, lora_model_id: int,
                              dtype: torch.dtype = torch.float32) -> "LoRAModel":
        tensors = load_file(str(Path(lora_dir) / WEIGHTS_NAME), device="cpu")
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            module, which = parse_fine_tuned_lora_name(name)
            pairs.setdefault(module, {})[which] = tensor.to(dtype)
        loras = {}
        for module, pair in pairs.items():
            if set(pair) != {"lora_A", "lora_B"}:
                raise ValueError(f"{WEIGHTS_NAME} in {str(lora_dir)!r} has lora_A without lora_B (or the "
                                 f"reverse) for {module}: the file is incomplete")
            a, b = pair["lora_A"], pair["lora_B"]
            if a.shape[0] != peft_helper.r or b.shape[1] != peft_helper.r:
                raise ValueError(f"{module} in {str(lora_dir)!r}: lora_A {tuple(a.shape)} / lora_B "
                                 f"{tuple(b.shape)} do not have rank r={peft_helper.r} (adapter_config.json)")
            loras[module] = LoRALayerWeights(module, peft_helper.r, peft_helper.lora_alpha, a, b,
                                             peft_helper.scaling)
        return cls(lora_model_id, peft_helper.r, loras)


def expected_lora_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each projection a LoRA may target, from a
    Llama-family config.json (the whole layer, before any tensor-parallel split)."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    hidden, inter = hf_config.hidden_size, getattr(hf_config, "intermediate_size", None)
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden)}
    if inter is not None:
        shapes.update(gate_proj=(hidden, inter), up_proj=(hidden, inter), down_proj=(inter, hidden))
    return shapes


def check_adapter_fits(lora_dir: str | Path, peft_helper: PEFTHelper, hf_config) -> None:
    """Refuse an adapter that was not trained on this base model (its matrices' shapes)
    or that adapts layers LoRA cannot wrap here (a mixture of experts' experts), reading
    only the safetensors header: the front end checks this before the request runs."""
    num_layers = hf_config.num_hidden_layers
    shapes = expected_lora_shapes(hf_config)
    try:
        weights = safe_open(str(Path(lora_dir) / WEIGHTS_NAME), framework="pt")
    except SafetensorError as error:   # a truncated or corrupt file: its header does not parse
        raise ValueError(f"{WEIGHTS_NAME} in {str(lora_dir)!r} is not a readable safetensors file ({error}): "
                         f"write it again with PeftModel.save_pretrained") from None
    with weights as f:
        for name in f.keys():
            module, which = parse_fine_tuned_lora_name(name)
            parts = module.split(".")
            servable = (len(parts) == 4 and parts[0] == "layers" and parts[1].isdigit()
                        and int(parts[1]) < num_layers and parts[2] in ("self_attn", "mlp")
                        and parts[3] in shapes)
            if not servable:
                raise ValueError(f"the adapter in {str(lora_dir)!r} adapts {module}, which LoRA cannot serve on "
                                 f"this model (only layers.N.self_attn.* / layers.N.mlp.* projections of "
                                 f"{list(shapes)}; not a mixture of experts' experts): retrain it without it")
            in_features, out_features = shapes[parts[3]]
            want = (peft_helper.r, in_features) if which == "lora_A" else (out_features, peft_helper.r)
            got = tuple(f.get_slice(name).get_shape())
            if got != want:
                raise ValueError(f"the adapter in {str(lora_dir)!r} has {name} of shape {got}, but this model "
                                 f"needs {want}: was it trained on another base model?")
