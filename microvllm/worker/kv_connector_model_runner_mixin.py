"""The worker side of a KV connector, called around one forward (vLLM:
``vllm/v1/worker/kv_connector_model_runner_mixin.py``)::

    bind_connector_metadata(plan.kv_connector_metadata)
    start_load_kv()                        blocks arrive in the KV cache
    wait_for_layer_load(layer)  x layers   (vLLM: inside each layer's attention)
        ... model_runner.execute_model(plan): the forward, sampling ...
    save_kv_layer(layer, kv)    x layers   (vLLM: inside each layer's attention)
    wait_for_save()                        blocks leave the KV cache
    get_finished(plan.finished_req_ids) -> KVConnectorOutput(finished_sending, finished_recving)
    get_failed_recving()                   -> KVConnectorOutput.failed_recving (compute instead)
    get_failed_sending()                   -> KVConnectorOutput.failed_sending (freed, not saved)
    clear_connector_metadata()

A step with no tokens to compute (only loads or saves) still runs all of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from microvllm.distributed.kv_transfer.kv_connector.base import KVConnectorBase, KVConnectorOutput


def layer_name(index: int) -> str:
    """The name a connector sees for layer ``index`` (vLLM's spelling of the attention layer)."""
    return f"model.layers.{index}.self_attn.attn"


@contextmanager
def kv_connector_step(connector: KVConnectorBase, scheduler_output, kv_caches: list) -> Iterator[KVConnectorOutput]:
    """Wrap one step's forward in the connector's calls; the yielded output is filled in
    when the block ends (only if the forward did not raise)."""
    output = KVConnectorOutput()
    connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
    try:
        connector.start_load_kv()
        for index in range(len(kv_caches)):
            connector.wait_for_layer_load(layer_name(index))
        yield output
        for index, kv_cache in enumerate(kv_caches):
            connector.save_kv_layer(layer_name(index), kv_cache)
        connector.wait_for_save()
        output.finished_sending, output.finished_recving = connector.get_finished(scheduler_output.finished_req_ids)
        output.failed_recving = connector.get_failed_recving()
        output.failed_sending = connector.get_failed_sending()
    finally:
        connector.clear_connector_metadata()
