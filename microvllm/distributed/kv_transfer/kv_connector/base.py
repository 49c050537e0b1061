"""``KVConnectorBase``: one class, two sides of one seam (vLLM:
``vllm/distributed/kv_transfer/kv_connector/v1/base.py``, the same method names).

The scheduler side decides which blocks move; the worker side moves the bytes. Each
engine step they talk once, through the plan and back through the runner's output::

    engine process (role SCHEDULER)                  worker (role WORKER)
    ───────────────────────────────                  ────────────────────
    a waiting request, after its local prefix hit:
      get_num_new_matched_tokens(req, n_local)
        -> (n_external, load_async)
      allocate_slots(...) for the external tokens
      update_state_after_alloc(req, blocks, n_ext)
      status WAITING_FOR_REMOTE_KVS
    schedule() -> plan
      build_connector_meta(plan) ──plan.kv_connector_metadata──> bind_connector_metadata
                                                                start_load_kv()   before the forward
                                                                wait_for_layer_load(layer)
                                                                  ... the forward ...
                                                                save_kv_layer(layer, kv)
                                                                wait_for_save()   after the forward
                                       ModelRunnerOutput   <──  get_finished(finished_req_ids)
    update_from_output(..., kv_connector_output)                 -> finished_sending, finished_recving
                                                                get_failed_recving(), get_failed_sending()
      update_connector_output(output)
      finished_recving: the request's loaded blocks are cached; it waits to be admitted
      finished_sending: the blocks of a finished request are freed now ("delayed free")
    a request finishes:
      request_finished(req, block_ids) -> (delay_free, kv_transfer_params)

Where microvllm differs from vLLM, and why:

- vLLM asks ``get_num_new_matched_tokens`` inside ``Scheduler.schedule()``; here
  ``schedule()`` is a course exercise, so the scheduler asks when a request arrives and
  after each step that did not preempt (``Scheduler._start_or_hold_kv_loads``), for the requests that could be admitted
  next. Every load is asynchronous: the request waits one step in WAITING_FOR_REMOTE_KVS
  and is admitted with the loaded blocks as prefix-cache hits.
- The layers do not call ``wait_for_layer_load`` / ``save_kv_layer`` from inside
  attention (that needs vLLM's global forward context); the runner calls them for every
  layer just before and just after the forward. On a CPU there is no copy engine to
  overlap a layer's transfer with the next layer's compute, so nothing is lost.
- Block ids come per cache group: ``block_ids[group][i]``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

# The worker side's report lives in core, which reads it and must not import from here;
# named here too so that a connector finds all of its seam in one module.
from microvllm.core.outputs import KVConnectorOutput  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from microvllm.config import EngineConfig
    from microvllm.core.kv_cache_manager import KVCacheBlocks
    from microvllm.core.kv_cache_spec import KVCacheSpec
    from microvllm.core.request import Request
    from microvllm.core.sched_output import SchedulerOutput


class KVConnectorRole(enum.Enum):
    """Which half of the connector this instance is (vLLM's names)."""

    SCHEDULER = 0   # in the engine process, beside the scheduler: decides
    WORKER = 1      # in each worker, beside the KV cache tensors: moves bytes


class KVConnectorMetadata:  # noqa: B903 (a marker base, as vLLM's)
    """What the scheduler side tells the worker side for one step (each connector
    subclasses it). It travels inside the plan, so it must pickle."""


class KVConnectorBase(ABC):
    """Base of every KV connector. One instance per side: ``role`` says which. The
    scheduler knows its scheduler side only as ``core``'s ``SchedulerConnector`` (the same
    method names), so that core never imports this module.

    ``num_kv_blocks``: the engine's KV pool (blocks per layer, the null block included);
    ``kv_cache_specs``: one spec per cache group (``core/kv_cache_spec.py``).
    """

    def __init__(self, config: EngineConfig, role: KVConnectorRole, num_kv_blocks: int,
                 kv_cache_specs: list[KVCacheSpec]) -> None:
        assert config.kv_transfer_config is not None
        self.config, self.role = config, role
        self.kv_transfer_config = config.kv_transfer_config
        self.num_kv_blocks, self.kv_cache_specs = num_kv_blocks, list(kv_cache_specs)
        self.block_size = config.cache_config.block_size
        self._connector_metadata: KVConnectorMetadata | None = None

    # ============================================================ worker side
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """The worker's KV cache, one tensor per layer ``[2, num_blocks, block_size,
        num_kv_heads, head_dim]`` (``worker/worker.py``), before the first step."""

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata | None) -> None:
        """This step's metadata, from the plan (called before ``start_load_kv``)."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """The step is over (called after ``get_finished``)."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata | None:
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self, **kwargs: Any) -> None:
        """Start loading this step's blocks into the KV cache, before the forward."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until layer ``layer_name``'s loads are in the cache (no-op: synchronous loads)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any = None, **kwargs: Any) -> None:
        """Start saving layer ``layer_name``'s KV (no-op: a connector that saves all layers
        at once does it in ``wait_for_save``)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves are done (or safely started), after the forward."""

    def get_finished(self, finished_req_ids: frozenset[str] | set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving): requests whose save / load completed
        since the last call. ``finished_req_ids``: requests the scheduler finished."""
        return None, None

    def get_failed_recving(self) -> set[str] | None:
        """Requests whose load failed since the last call (after ``get_finished``): they
        compute their prompt instead (vLLM: ``get_block_ids_with_load_errors``)."""
        return None

    def get_failed_sending(self) -> set[str] | None:
        """Requests whose save failed since the last call (after ``get_finished``, which
        reports them finished too: their blocks are freed, but nothing was saved)."""
        return None

    # ========================================================= scheduler side
    def check_request(self, kv_transfer_params: dict | None, prompt_token_ids: list[int]) -> None:
        """Raise ``ValueError`` (a 400) for a request this connector must refuse before it
        is queued: its ``kv_transfer_params`` (untrusted: from the request body) ask for
        something the operator did not allow. Not in vLLM, which trusts them."""

    def request_refused(self, kv_transfer_params: dict | None, prompt_token_ids: list[int] | None) -> None:
        """A request carrying ``kv_transfer_params`` was refused before it was queued: let
        a peer holding KV for it go (not in vLLM; its peers wait for their timeout)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens past ``num_computed_tokens`` (the local prefix hit, whole
        blocks) this connector can load for ``request``, and whether the load is
        asynchronous (microvllm treats every load as asynchronous). Never the request's
        last token: it is computed so that there are logits to sample from."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """The scheduler allocated ``blocks`` (all of the request's blocks; the
        external tokens' blocks follow the local hit) for ``num_external_tokens``
        tokens to load. Remember the load for ``build_connector_meta``."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and saves for the worker side; resets what was handed over."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The worker side's report of a step (``get_finished``), before the scheduler acts on it."""

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """A request finished (or was aborted) holding ``block_ids`` (one list per cache
        group). Returns (delay_free, kv_transfer_params): ``delay_free`` True keeps the
        blocks allocated until the worker reports the request in ``finished_sending``;
        ``kv_transfer_params`` go back to the client (disaggregated serving)."""
        return False, None
