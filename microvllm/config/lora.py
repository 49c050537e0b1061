"""``LoRAConfig``: how many adapters the engine serves at once (vLLM: ``vllm/config/lora.py``).

    max_loras       adapters in the device's slots: at most this many distinct adapters in one step
    max_lora_rank   the slots' rank (an adapter of smaller rank fills part of its slot, zeros after)
    max_cpu_loras   adapters kept loaded on the CPU (an LRU behind the slots); >= max_loras

Present (not None) in ``EngineConfig.lora_config`` only with ``enable_lora=True``.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's allowed ranks (its --max-lora-rank choices).
SUPPORTED_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRAConfig:
    max_lora_rank: int = 16
    max_loras: int = 1
    max_cpu_loras: int | None = None   # None: max_loras

    def __post_init__(self):
        if self.max_lora_rank not in SUPPORTED_LORA_RANKS:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} must be one of {SUPPORTED_LORA_RANKS} "
                             f"(vLLM's choices); pick the smallest that is >= your adapters' r")
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras!r} must be an int >= 1 (adapters served in one step)")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}: the "
                             f"adapters in the device slots are also kept on the CPU")
