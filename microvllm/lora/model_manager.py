"""``LoRAModelManager``: the model's wrapped layers, the device slots and the CPU cache of
adapters behind them (vLLM: ``vllm/lora/model_manager.py``, ``LRUCacheLoRAModelManager``).

Like the KV block pool, adapters live in a fixed number of device slots, filled on demand
and reused least-recently-used first::

    CPU cache (max_cpu_loras, LRU)     {7: LoRAModel, 3: LoRAModel, 9: LoRAModel}
                                          │ activate_adapter(7): copy into a free slot
    device slots (max_loras)           [ 3 | 7 ]     lora_index_to_id = [3, 7]
                                          │ every wrapped layer's lora_a/b_stacked[slot]
    this step's tokens                 a0 a1 b0 c0   -> slots 1 1 -1 0 (punica_wrapper.py)

At most ``max_loras`` distinct adapters run in one step (the scheduler sees to it), so a
step's adapters always fit the slots.

Our fused layers take several of Hugging Face's modules (what peft names)::

    qkv_proj      q_proj, k_proj, v_proj     three slices
    gate_up_proj  gate_proj, up_proj         two slices
    o_proj, down_proj                         one slice each
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from microvllm.config.lora import LoRAConfig
from microvllm.lora.layers import BaseLayerWithLoRA, from_layer
from microvllm.lora.lora_model import LoRAModel
from microvllm.lora.punica_wrapper import LoRAMapping, PunicaWrapperBase, PunicaWrapperCPU

# Our module -> the Hugging Face modules it fuses (vLLM: a model's packed_modules_mapping).
PACKED_MODULES_MAPPING = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                          "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


class LoRAModelManager:
    def __init__(self, model: nn.Module, lora_config: LoRAConfig, max_num_batched_tokens: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 punica_wrapper: PunicaWrapperBase | None = None):
        self.model, self.lora_config, self.dtype = model, lora_config, dtype
        self.lora_slots = lora_config.max_loras
        self.capacity: int = lora_config.max_cpu_loras or lora_config.max_loras
        self.lora_index_to_id: list[int | None] = [None] * self.lora_slots
        self.punica_wrapper = punica_wrapper or PunicaWrapperCPU(max_num_batched_tokens, device)
        self._registered_adapters: OrderedDict[int, LoRAModel] = OrderedDict()   # CPU, LRU first
        self._active_adapters: OrderedDict[int, int] = OrderedDict()             # id -> slot, LRU first
        self.modules: dict[str, BaseLayerWithLoRA] = {}
        self._create_lora_modules()

    # ------------------------------------------------------------------ the layers
    def _create_lora_modules(self) -> None:
        """Replace each projection LoRA can adapt with its wrapper, in place."""
        for name, module in list(self.model.named_modules()):
            parent_name, _, attr = name.rpartition(".")
            if attr not in PACKED_MODULES_MAPPING:
                continue
            wrapper = from_layer(module)
            if wrapper is None:   # e.g. a mixture of experts' layers: not served with LoRA
                continue
            wrapper.create_lora_weights(self.lora_slots, self.lora_config.max_lora_rank, self.dtype)
            wrapper.set_mapping(self.punica_wrapper)
            setattr(self.model.get_submodule(parent_name) if parent_name else self.model, attr, wrapper)
            self.modules[name] = wrapper
        if not self.modules:
            raise ValueError(f"{type(self.model).__name__} has no layer LoRA can wrap (its projections must be "
                             f"named {list(PACKED_MODULES_MAPPING)}): start the engine without enable_lora")

    def _hf_names(self, module_name: str) -> list[str]:
        """``"layers.0.self_attn.qkv_proj"`` -> ``["layers.0.self_attn.q_proj", ...k_proj, ...v_proj]``."""
        prefix, _, attr = module_name.rpartition(".")
        return [f"{prefix}.{sub}" if prefix else sub for sub in PACKED_MODULES_MAPPING[attr]]

    # ------------------------------------------------------------------ CPU cache
    def add_adapter(self, lora: LoRAModel) -> bool:
        """Keep ``lora`` on the CPU (evicting the least recently used one when full).
        False if it was there already. Refused if it targets a module this model lacks."""
        if lora.id in self._registered_adapters:
            self._registered_adapters.move_to_end(lora.id)
            return False
        known = {hf for name in self.modules for hf in self._hf_names(name)}
        unknown = sorted(set(lora.loras) - known)
        if unknown:
            raise ValueError(f"adapter {lora.id} targets {unknown[:3]}{' ...' if len(unknown) > 3 else ''}, which "
                             f"this model has no LoRA layer for (mixture-of-experts and LM-head layers are "
                             f"not served with LoRA); retrain it without those target modules")
        if lora.rank > self.lora_config.max_lora_rank:
            raise ValueError(f"adapter {lora.id} has rank {lora.rank} > max_lora_rank="
                             f"{self.lora_config.max_lora_rank}: raise max_lora_rank")
        while len(self._registered_adapters) >= self.capacity:
            self.remove_adapter(next(iter(self._registered_adapters)))
        self._registered_adapters[lora.id] = lora
        return True

    def remove_adapter(self, adapter_id: int) -> bool:
        self.deactivate_adapter(adapter_id)
        return self._registered_adapters.pop(adapter_id, None) is not None

    def list_adapters(self) -> dict[int, LoRAModel]:
        return dict(self._registered_adapters)

    def get_adapter(self, adapter_id: int) -> LoRAModel | None:
        return self._registered_adapters.get(adapter_id)

    # ------------------------------------------------------------------ device slots
    def activate_adapter(self, adapter_id: int) -> bool:
        """Copy a registered adapter into a slot (the least recently used one when all are
        taken). False if it already holds one."""
        if adapter_id in self._active_adapters:
            self._active_adapters.move_to_end(adapter_id)
            self._registered_adapters.move_to_end(adapter_id)
            return False
        lora = self._registered_adapters[adapter_id]
        if len(self._active_adapters) >= self.lora_slots:
            self.deactivate_adapter(next(iter(self._active_adapters)))
        slot = self.lora_index_to_id.index(None)
        for name, module in self.modules.items():
            parts = [lora.get_lora(hf) for hf in self._hf_names(name)]
            module.set_lora(slot, [p.lora_a if p else None for p in parts],
                            [p.lora_b * p.scaling if p else None for p in parts])
        self.lora_index_to_id[slot] = adapter_id
        self._active_adapters[adapter_id] = slot
        return True

    def deactivate_adapter(self, adapter_id: int) -> bool:
        slot = self._active_adapters.pop(adapter_id, None)
        if slot is None:
            return False
        self.lora_index_to_id[slot] = None
        for module in self.modules.values():
            module.reset_lora(slot)
        return True

    def set_adapter_mapping(self, mapping: LoRAMapping | None) -> None:
        """This step's token -> slot mapping for every wrapped layer (None: no adapter)."""
        if mapping is None:
            self.punica_wrapper.clear()
        else:
            self.punica_wrapper.update_metadata(mapping, self.lora_index_to_id)
