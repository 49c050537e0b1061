"""``KVConnectorFactory``: a connector class by its name (vLLM:
``kv_connector/factory.py``). Each connector's module is imported only when it is asked
for (a plain ``import`` inside its loader, as ``attention/selector.py`` loads backends),
so core and the engine never import a concrete connector."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from microvllm.distributed.kv_transfer.kv_connector.base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from microvllm.config import EngineConfig
    from microvllm.core.kv_cache_spec import KVCacheSpec


class KVConnectorFactory:
    _registry: dict[str, Callable[[], type[KVConnectorBase]]] = {}

    @classmethod
    def register_connector(cls, name: str, loader: Callable[[], type[KVConnectorBase]]) -> None:
        """``loader()`` imports the connector's module and returns its class."""
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered")
        cls._registry[name] = loader

    @classmethod
    def get_connector_class(cls, name: str) -> type[KVConnectorBase]:
        if name not in cls._registry:
            raise ValueError(f"kv_transfer_config kv_connector={name!r} is not a connector: choose one of "
                             f"{sorted(cls._registry)}")
        return cls._registry[name]()

    @classmethod
    def create_connector(cls, config: EngineConfig, role: KVConnectorRole, num_kv_blocks: int,
                         kv_cache_specs: list[KVCacheSpec]) -> KVConnectorBase:
        """The connector ``config.kv_transfer_config`` names, for one side (``role``)."""
        transfer = config.kv_transfer_config
        if transfer is None or transfer.kv_connector is None:
            raise ValueError("no kv_transfer_config: set LLM(kv_transfer_config={'kv_connector': ..., "
                             "'kv_role': ...}) to run a KV connector")
        return cls.get_connector_class(transfer.kv_connector)(config, role, num_kv_blocks, kv_cache_specs)


def _offloading_connector() -> type[KVConnectorBase]:
    from microvllm.distributed.kv_transfer.kv_connector.offloading_connector import OffloadingConnector
    return OffloadingConnector


KVConnectorFactory.register_connector("OffloadingConnector", _offloading_connector)


def _p2p_connector() -> type[KVConnectorBase]:
    from microvllm.distributed.kv_transfer.kv_connector.p2p_connector import P2PConnector
    return P2PConnector


KVConnectorFactory.register_connector("P2PConnector", _p2p_connector)
