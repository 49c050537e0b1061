"""``LRUCacheWorkerLoRAManager``: the worker's side of LoRA (vLLM: ``vllm/lora/worker_manager.py``).

Per step the model runner hands it the step's adapters and its token mapping::

    set_active_adapters({LoRARequest("sql", 7, path), ...}, LoRAMapping(index_mapping=(7, 7, 0, 3)))
        each adapter: loaded from its peft folder once (then kept in the CPU LRU),
        copied into a device slot if it holds none; then the mapping is set

and the forward that follows runs each token with its adapter.
"""

from __future__ import annotations

import torch
from torch import nn

from microvllm.config.lora import LoRAConfig
from microvllm.lora.lora_model import LoRAModel
from microvllm.lora.model_manager import LoRAModelManager
from microvllm.lora.peft_helper import PEFTHelper
from microvllm.lora.punica_wrapper import LoRAMapping
from microvllm.lora.request import LoRARequest


class LRUCacheWorkerLoRAManager:
    def __init__(self, lora_config: LoRAConfig, max_num_batched_tokens: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.lora_config, self.max_num_batched_tokens = lora_config, max_num_batched_tokens
        self.dtype, self.device = dtype, device
        self._adapter_manager: LoRAModelManager | None = None

    def create_lora_manager(self, model: nn.Module) -> nn.Module:
        """Wrap ``model``'s layers in place (``LoRAModelManager``); returns the model."""
        self._adapter_manager = LoRAModelManager(model, self.lora_config, self.max_num_batched_tokens,
                                                 self.dtype, self.device)
        return model

    @property
    def adapter_manager(self) -> LoRAModelManager:
        if self._adapter_manager is None:
            raise RuntimeError("create_lora_manager(model) must run first")
        return self._adapter_manager

    def _load_adapter(self, lora_request: LoRARequest) -> LoRAModel:
        peft_helper = PEFTHelper.from_local_dir(lora_request.lora_path)
        peft_helper.validate_legal(self.lora_config.max_lora_rank)
        return LoRAModel.from_local_checkpoint(lora_request.lora_path, peft_helper, lora_request.lora_int_id,
                                               dtype=self.dtype)

    def add_adapter(self, lora_request: LoRARequest) -> bool:
        """Load the adapter into the CPU cache (if it is not there); True if it was loaded now."""
        manager = self.adapter_manager
        loaded = manager.get_adapter(lora_request.lora_int_id)
        if loaded is not None:
            manager.add_adapter(loaded)   # marks it recently used
            return False
        return manager.add_adapter(self._load_adapter(lora_request))

    def remove_adapter(self, adapter_id: int) -> bool:
        return self.adapter_manager.remove_adapter(adapter_id)

    def remove_all_adapters(self) -> None:
        for adapter_id in list(self.adapter_manager.list_adapters()):
            self.adapter_manager.remove_adapter(adapter_id)

    def list_adapters(self) -> set[int]:
        return set(self.adapter_manager.list_adapters())

    def set_active_adapters(self, requests: set[LoRARequest], mapping: LoRAMapping | None) -> None:
        """Make ``requests``' adapters resident in slots, then set the step's mapping."""
        if len(requests) > self.lora_config.max_loras:
            raise RuntimeError(f"{len(requests)} adapters in one step, above max_loras={self.lora_config.max_loras}"
                               f" (the scheduler should never do this)")
        manager = self.adapter_manager
        ordered = sorted(requests, key=lambda r: r.lora_int_id)
        # Those already resident first, so that making room never evicts one this step needs.
        for request in ordered:
            if manager.get_adapter(request.lora_int_id) is not None:
                self.add_adapter(request)
                if request.lora_int_id in manager.lora_index_to_id:
                    manager.activate_adapter(request.lora_int_id)
        for request in ordered:
            self.add_adapter(request)
            manager.activate_adapter(request.lora_int_id)
        manager.set_adapter_mapping(mapping)
