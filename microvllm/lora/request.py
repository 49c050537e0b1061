"""``LoRARequest``: which adapter a request runs with (vLLM: ``vllm/lora/request.py``)::

    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql-lora"))

``lora_name`` is what a client calls it (a served model's name); ``lora_int_id`` (>= 1) the
engine's number for it: the same id must always mean the same adapter. ``lora_path`` is a
peft folder (``adapter_config.json`` + ``adapter_model.safetensors``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} must be an int >= 1 (0 is the base model)")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string (the name clients use for the adapter)")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
