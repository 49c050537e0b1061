"""Moving KV blocks between engines and tiers (vLLM: ``vllm/distributed/kv_transfer/``).

    kv_connector/base.py                  KVConnectorBase: a scheduler side and a worker side
    kv_connector/factory.py               a connector by its name (``kv_transfer_config``)
    kv_connector/offloading_connector.py  a second KV tier (vLLM's OffloadingConnector)

The configuration is ``config/kv_transfer.py`` (``KVTransferConfig``). Core sees only
the base class; nothing in ``core/`` knows which connector runs.
"""
