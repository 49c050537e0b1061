"""The engine's configuration: resolved once, then frozen (vLLM: ``vllm/config/``).

``EngineArgs`` (``engine/arg_utils.py``) is the one list of options a user sets, with
their defaults, docs and flags. ``EngineArgs.create_engine_config()`` settles every
``"auto"`` against the platform and the model's config.json, checks the combination,
and returns this frozen tree; nothing writes to it afterwards::

    EngineConfig                       (vLLM: VllmConfig)
    ├── model_config      ModelConfig      the folder, its config.json, dtype, seed
    ├── cache_config      CacheConfig      block size, prefix caching, the KV budget
    ├── scheduler_config  SchedulerConfig  the step's limits (core/config.py: core stays
    │                                      pure Python, so it lives there)
    ├── parallel_config   ParallelConfig   tensor_parallel_size
    ├── device_config     DeviceConfig     cpu / cuda, attention backend, enforce_eager
    ├── structured_outputs_config          which backend compiles grammars
    ├── speculative_config SpeculativeConfig | None   who drafts tokens for the target to check
    ├── profiler_config   dict | None      vLLM's profiler settings (start_profile)
    ├── kv_events_config  KVEventsConfig | None   KV cache events for a router (publisher, endpoint)
    ├── kv_transfer_config KVTransferConfig | None  which KV connector runs, in which role
    └── lora_config       LoRAConfig | None  adapter slots (enable_lora=True)

Each field lives in exactly one of these classes. What the engine learns later (the
number of KV blocks the executor's profiling allows) is the engine's own state, never
written back here. The course's hooks (``components``, ``trace``, ``debug_invariants``)
are not settings of the engine: they are passed beside the config (``Engine(config,
components=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from microvllm.config.cache import DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_KV_CACHE_BYTES, CacheConfig
from microvllm.config.device import DEVICES, DeviceConfig
from microvllm.config.kv_events import KVEventsConfig
from microvllm.config.kv_transfer import KVTransferConfig
from microvllm.config.lora import LoRAConfig
from microvllm.config.model import DTYPES, ModelConfig, resolve_dtype
from microvllm.config.parallel import ParallelConfig
from microvllm.config.speculative import SpeculativeConfig
from microvllm.config.structured_outputs import StructuredOutputsConfig
from microvllm.core.config import SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    """Every resolved setting of one engine (vLLM: ``VllmConfig``); frozen."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: SpeculativeConfig | None = None
    profiler_config: dict | None = None
    """vLLM's ``{"profiler": "torch", "torch_profiler_dir": ...}`` for ``start_profile()``."""
    kv_events_config: KVEventsConfig | None = None
    kv_transfer_config: KVTransferConfig | None = None
    lora_config: LoRAConfig | None = None


VllmConfig = EngineConfig  # vLLM's name

__all__ = ["CacheConfig", "DEFAULT_GPU_MEMORY_UTILIZATION", "DEFAULT_KV_CACHE_BYTES", "DEVICES", "DTYPES",
           "DeviceConfig", "EngineConfig", "KVEventsConfig", "KVTransferConfig", "LoRAConfig", "ModelConfig",
           "ParallelConfig",
           "SchedulerConfig", "SpeculativeConfig", "StructuredOutputsConfig", "VllmConfig",
           "resolve_dtype"]
