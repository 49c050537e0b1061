"""``SchedulerConnector``: the KV connector as the scheduler sees it.

The connectors live above core, in ``distributed/kv_transfer/`` (``KVConnectorBase`` and
its subclasses); core never imports them, not even for a type. It names here the five
calls it makes, and any object that has them will do: ``KVConnectorBase`` does, and so
does a test's fake. The worker side (``start_load_kv``, ``get_finished``, ...) and the
engine's calls (``check_request``) are not the scheduler's business, so they are not here.

    the scheduler                           its call
    a waiting request, past its local hit   get_num_new_matched_tokens -> (tokens, load_async)
    blocks allocated for those tokens       update_state_after_alloc
    end of schedule()                       build_connector_meta -> plan.kv_connector_metadata
    the worker's report of a step           update_connector_output(KVConnectorOutput)
    a request finished                      request_finished -> (delay_free, kv_transfer_params)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from microvllm.core.kv_cache_manager import KVCacheBlocks
    from microvllm.core.outputs import KVConnectorOutput
    from microvllm.core.request import Request
    from microvllm.core.sched_output import SchedulerOutput


class SchedulerConnector(Protocol):
    """The scheduler side of a KV connector (``KVConnectorBase``'s methods of the same
    names say what each must do)."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]: ...

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any: ...

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None: ...

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]: ...
