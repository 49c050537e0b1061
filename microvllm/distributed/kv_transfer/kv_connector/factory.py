"""``KVConnectorFactory``: a connector class by its name (vLLM:
``kv_connector/factory.py``). Modules are imported only when their connector is asked
for, so core and the engine never import a concrete connector."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from microvllm.distributed.kv_transfer.kv_connector.base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from microvllm.config import EngineConfig
    from microvllm.core.kv_cache_spec import KVCacheSpec


class KVConnectorFactory:
    _registry: dict[str, tuple[str, str]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def get_connector_class(cls, name: str) -> type[KVConnectorBase]:
        if name not in cls._registry:
            raise ValueError(f"kv_transfer_config kv_connector={name!r} is not a connector: choose one of "
                             f"{sorted(cls._registry)}")
        module_path, class_name = cls._registry[name]
        return getattr(importlib.import_module(module_path), class_name)

    @classmethod
    def create_connector(cls, config: EngineConfig, role: KVConnectorRole, num_kv_blocks: int,
                         kv_cache_specs: list[KVCacheSpec]) -> KVConnectorBase:
        """The connector ``config.kv_transfer_config`` names, for one side (``role``)."""
        transfer = config.kv_transfer_config
        if transfer is None or transfer.kv_connector is None:
            raise ValueError("no kv_transfer_config: set LLM(kv_transfer_config={'kv_connector': ..., "
                             "'kv_role': ...}) to run a KV connector")
        return cls.get_connector_class(transfer.kv_connector)(config, role, num_kv_blocks, kv_cache_specs)


KVConnectorFactory.register_connector(
    "OffloadingConnector", "microvllm.distributed.kv_transfer.kv_connector.offloading_connector",
    "OffloadingConnector")
