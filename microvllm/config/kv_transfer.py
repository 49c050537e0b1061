"""``KVTransferConfig``: which KV connector the engine runs, in which role (vLLM:
``vllm/config/kv_transfer.py``, the same names). Given as vLLM takes it, a dict or its JSON::

    LLM(kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both"})
    microvllm serve --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}'

    kv_connector               the connector's name in the factory
                               (``distributed/kv_transfer/kv_connector/factory.py``)
    kv_role                    kv_producer (saves / sends KV), kv_consumer (loads / receives
                               it) or kv_both (a second tier: saves and loads its own)
    kv_connector_extra_config  the connector's own options (the offloading connector:
                               ``num_cpu_blocks``, ``path``)
    engine_id                  this engine's name for a remote peer (None: a fresh one)
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, fields

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """A resolved ``kv_transfer_config`` (see the module docstring); frozen."""

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict = field(default_factory=dict)
    engine_id: str | None = None

    def __post_init__(self) -> None:
        if self.engine_id is None:
            object.__setattr__(self, "engine_id", str(uuid.uuid4()))

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default):
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_dict(cls, options: dict | str | KVTransferConfig) -> KVTransferConfig:
        """Check every key and value; a JSON string is parsed first (the CLI's form)."""
        if isinstance(options, KVTransferConfig):
            options._check()
            return options
        if isinstance(options, str):
            try:
                options = json.loads(options)
            except json.JSONDecodeError as error:
                raise ValueError(f"kv_transfer_config={options!r} is not valid JSON ({error}): give a dict such as "
                                 '\'{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}\'') from None
        if not isinstance(options, dict):
            raise TypeError(f"kv_transfer_config={options!r} must be a dict such as "
                            '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}')
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown key(s) {unknown}: the keys are {known}")
        config = cls(**options)
        config._check()
        return config

    def _check(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(f"kv_transfer_config kv_connector={self.kv_connector!r}: name a connector, "
                             'e.g. "OffloadingConnector"')
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config kv_role={self.kv_role!r}: set it to one of {list(KV_ROLES)} "
                             '(a second tier on one engine: "kv_both")')
        if not isinstance(self.kv_connector_extra_config, dict):
            raise TypeError(f"kv_transfer_config kv_connector_extra_config={self.kv_connector_extra_config!r} "
                            "must be a dict")
        if not isinstance(self.engine_id, str):
            raise TypeError(f"kv_transfer_config engine_id={self.engine_id!r} must be a string or null")
