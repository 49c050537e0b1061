"""``OffloadingConnector``: a second KV tier behind the block pool (vLLM: the
offloading connector and ``vllm/v1/kv_offload/``; SGLang's HiCache in miniature).

    block pool (the KV cache)        second store (this connector)
    ┌──┬──┬──┬──┬──┐  save at finish  ┌──┬──┬──┬──┬──┬──┬──┬──┬──┬──┐
    │b1│b2│b3│b4│b5│ ───────────────> │  slots, keyed by block hash,    │  LRU, its own
    └──┴──┴──┴──┴──┘ <─────────────── │  num_cpu_blocks of them          │  capacity
                      load on a hit   └──┴──┴──┴──┴──┴──┴──┴──┴──┴──┴──┘

- Save (demote): when a request finishes, its computed full blocks whose hashes the
  store lacks are copied into free (or least recently used) slots. The request's free is
  delayed until the copy is done (``request_finished`` -> delay_free), so no block is
  reused while it is read. Blocks are copied when their request finishes, not when the
  pool evicts them: eviction happens inside ``allocate_slots``, when the block is already
  being handed to another request's KV, too late to read it (vLLM's connector stores
  as blocks fill, for the same reason).
- Load (promote): a new request whose prefix runs past the pool's hit into blocks the
  store holds gets them copied back into fresh blocks before it is admitted; the
  scheduler then sees them as ordinary prefix-cache hits.

What a second tier buys:

- On a GPU: capacity. HBM holds the KV pool; host RAM is ten times larger, and copying
  a block back over PCIe / NVLink costs far less than recomputing its prefill.
- On a CPU the pool is already in host memory, so a second RAM tier is only the same
  memory under another policy. It pays when it holds more than the pool could: a pool
  kept small (``num_kv_blocks`` / ``kv_cache_memory_bytes``, the budget the scheduler
  plans with) plus a larger store; a compressed store (``"dtype": "float16"`` halves a
  float32 cache, at the cost of exactly matching tokens); or a store on disk
  (``"path"``: a memory-mapped file that the page cache keeps warm and the OS may page
  out), where KV outlives what RAM is given to the engine.

Options (``kv_connector_extra_config``): ``num_cpu_blocks`` (the store's slots; default
twice the pool's blocks: that much more memory), ``dtype`` (default the cache's:
exact), ``path`` (a file to memory-map; default in RAM). ``kv_role``: kv_both saves and
loads; kv_producer only saves; kv_consumer only loads.

The file (``file_store.py``): opened with ``O_NOFOLLOW`` (a symlink is refused), created
0600 (an existing file of this user's is set to 0600 and reused), locked against a second
engine, and its whole size reserved at start (``posix_fallocate``): a filesystem too small
fails at construction with what to change, never with SIGBUS on a later save. With
several tensor-parallel ranks or data-parallel cores each has its own file: ``path`` for
the first, ``path.dp<d>.tp<t>`` for the others.

A tier that fails is turned off, never the server: a save (or load) that raises logs one
warning, the worker side skips every later copy, reports the failed save as finished (its
blocks are freed) and in ``failed_sending`` (the scheduler side then forgets the store and
offers nothing more), and any load still planned is reported failed: its request computes
those tokens instead, with the same greedy tokens.

The worker side copies synchronously: loads before the forward, saves right after it,
both reported in the same step. So anything handed to the worker and not reported by the
next ``build_connector_meta`` belongs to a step that failed, and is forgotten.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from microvllm.core import scheduler_kv_connector
from microvllm.distributed.kv_transfer.kv_connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from microvllm.distributed.kv_transfer.kv_connector.file_store import StoreFile, open_store_file

if TYPE_CHECKING:
    from microvllm.config import EngineConfig
    from microvllm.core.kv_cache_manager import KVCacheBlocks
    from microvllm.core.kv_cache_spec import KVCacheSpec
    from microvllm.core.request import Request
    from microvllm.core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)

# (block ids in the pool, slots in the store), the same length: block_ids[i] <-> slots[i]
Transfer = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    """One step's copies, per request: store -> pool (loads), pool -> store (saves)."""

    reqs_to_load: dict[str, Transfer] = field(default_factory=dict)
    reqs_to_store: dict[str, Transfer] = field(default_factory=dict)


def num_store_blocks(config: EngineConfig, num_kv_blocks: int) -> int:
    """The store's slots: ``num_cpu_blocks``, else twice the pool's blocks (both sides agree).
    The store copies what the pool holds (blocks are saved while still in the pool), so it
    adds capacity only beyond the pool's size: one the pool's size would mostly hold the
    same blocks."""
    assert config.kv_transfer_config is not None
    value = config.kv_transfer_config.get_from_extra_config("num_cpu_blocks", 2 * num_kv_blocks)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"kv_connector_extra_config num_cpu_blocks={value!r} must be an int of at least 1")
    return value


class OffloadingConnector(KVConnectorBase):
    """A second KV tier: the scheduler side keeps the store's index (hash -> slot, LRU);
    the worker side keeps the store's bytes and copies blocks in and out."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, num_kv_blocks: int,
                 kv_cache_specs: list[KVCacheSpec]) -> None:
        super().__init__(config, role, num_kv_blocks, kv_cache_specs)
        if len(kv_cache_specs) != 1 or type(kv_cache_specs[0]).__name__ != "FullAttentionSpec":
            raise ValueError("OffloadingConnector needs a model whose layers all use full attention (one "
                             f"cache group), but its cache groups are {kv_cache_specs}: drop kv_transfer_config")
        if not config.cache_config.enable_prefix_caching:
            raise ValueError("OffloadingConnector hands loaded blocks to the scheduler as prefix-cache hits: "
                             "set enable_prefix_caching=True")
        self.num_slots = num_store_blocks(config, num_kv_blocks)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler_side()
        else:
            self._init_worker_side()

    # ========================================================= scheduler side
    def _init_scheduler_side(self) -> None:
        self.stored: OrderedDict[Any, int] = OrderedDict()   # block hash -> slot; LRU first
        self.free_slots: list[int] = list(range(self.num_slots - 1, -1, -1))
        self.slot_readers: Counter[int] = Counter()   # slots a planned load reads: never evicted
        self.pending_hashes: set = set()              # being saved: not saved twice
        self._matched: dict[str, int] = {}            # request -> local hit tokens it was asked with
        self._loads: dict[str, Transfer] = {}         # not yet handed to the worker
        self._stores: dict[str, tuple[Transfer, tuple]] = {}   # (transfer, hashes)
        self._loads_in_flight: dict[str, Transfer] = {}
        self._stores_in_flight: dict[str, tuple[Transfer, tuple]] = {}
        # Counters for a learner or a benchmark: blocks loaded / saved, and lookups.
        self.num_blocks_loaded = self.num_blocks_saved = 0
        self.disabled = False   # the worker side reported a failed save: the tier is off

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Whole blocks past the local hit whose hashes the store holds, in a row; never the
        block holding the last token (it is computed, for the logits). O(blocks)."""
        if not self.kv_transfer_config.is_kv_consumer or self.disabled:
            return 0, False
        plan = scheduler_kv_connector.plan_kv_load(request.block_hashes, request.num_tokens, num_computed_tokens,
                                                   self.block_size, self.stored)   # exercise 19
        if plan.num_external_tokens:
            self._matched[request.request_id] = num_computed_tokens
        return plan.num_external_tokens, plan.load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        num_local = self._matched.pop(request.request_id, None)
        if num_external_tokens == 0 or num_local is None:
            return
        first, count = num_local // self.block_size, num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0][first:first + count]
        slots = tuple(self.stored[h] for h in request.block_hashes[first:first + count])
        for block_hash in request.block_hashes[first:first + count]:
            self.stored.move_to_end(block_hash)   # just used: evicted last
        self.slot_readers.update(slots)
        self._loads[request.request_id] = (tuple(block_ids), slots)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        self._forget_unreported()
        metadata = OffloadingConnectorMetadata(
            reqs_to_load=dict(self._loads),
            reqs_to_store={rid: transfer for rid, (transfer, _) in self._stores.items()})
        self._loads_in_flight, self._stores_in_flight = self._loads, self._stores
        self._loads, self._stores = {}, {}
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Loads done: their slots may be evicted again. Saves done: their hashes are in
        the store (only now: a half-written slot is never offered). A failed save: the
        worker turned the tier off (as does a failed load: it fails loads only when off),
        so this side forgets the store and offers nothing more."""
        if (connector_output.failed_sending or connector_output.failed_recving) and not self.disabled:
            self.disabled = True
            self.stored.clear()
            self.pending_hashes.clear()
            self.free_slots = []
        for request_id in connector_output.failed_sending or ():
            self._stores_in_flight.pop(request_id, None)   # finished (blocks freed), never stored
        for request_id in connector_output.failed_recving or ():   # computed instead
            transfer = self._loads_in_flight.pop(request_id, None)
            if transfer is not None:
                self.slot_readers.subtract(transfer[1])
        for request_id in connector_output.finished_recving or ():
            transfer = self._loads_in_flight.pop(request_id, None)
            if transfer is not None:
                self.slot_readers.subtract(transfer[1])
                self.num_blocks_loaded += len(transfer[1])
        for request_id in connector_output.finished_sending or ():
            entry = self._stores_in_flight.pop(request_id, None)
            if entry is None or self.disabled:
                continue
            (_, slots), hashes = entry
            for block_hash, slot in zip(hashes, slots):
                self.pending_hashes.discard(block_hash)
                self.stored[block_hash] = slot
            self.num_blocks_saved += len(slots)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """Save the request's computed full blocks the store lacks; delay the free if any."""
        load = self._loads.pop(request.request_id, None)   # aborted before its load was sent
        if load is not None:
            self.slot_readers.subtract(load[1])
        self._matched.pop(request.request_id, None)
        if not self.kv_transfer_config.is_kv_producer or self.disabled:
            return False, None
        num_full = min(request.num_computed_tokens // self.block_size, len(block_ids[0]))
        blocks, slots, hashes = [], [], []
        for index, block_hash in enumerate(request.block_hashes[:num_full]):
            if block_hash in self.stored:
                self.stored.move_to_end(block_hash)
                continue
            if block_hash in self.pending_hashes:
                continue
            slot = self._take_slot()
            if slot is None:
                break
            blocks.append(block_ids[0][index])
            slots.append(slot)
            hashes.append(block_hash)
            self.pending_hashes.add(block_hash)
        if not slots:
            return False, None
        self._stores[request.request_id] = ((tuple(blocks), tuple(slots)), tuple(hashes))
        return True, None

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used one no planned load reads. O(stored) worst case."""
        if self.free_slots:
            return self.free_slots.pop()
        for block_hash, slot in self.stored.items():
            if self.slot_readers[slot] <= 0:
                del self.stored[block_hash]
                return slot
        return None

    def _forget_unreported(self) -> None:
        """What the last plan handed over and the worker never reported was in a failed
        step: its loads read nothing any more, its half-saved slots are free again."""
        for _, slots in self._loads_in_flight.values():
            self.slot_readers.subtract(slots)
        for (_, slots), hashes in self._stores_in_flight.values():
            self.free_slots.extend(slots)
            self.pending_hashes.difference_update(hashes)
        self._loads_in_flight, self._stores_in_flight = {}, {}

    # ============================================================ worker side
    def _init_worker_side(self) -> None:
        self.kv_caches: list[torch.Tensor] = []
        self.store: list[torch.Tensor] = []   # per layer [2, num_slots, block_size, heads, head_dim]
        self.store_file: StoreFile | None = None   # the "path" tier's open, reserved file
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_sending: set[str] = set()
        self._failed_recving: set[str] = set()
        self.failed: BaseException | None = None   # the error that turned the tier off

    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """Allocate the store beside the cache: RAM (or ``path``, memory-mapped), in the
        cache's dtype unless ``dtype`` says otherwise."""
        self.kv_caches = kv_caches
        extra = self.kv_transfer_config.kv_connector_extra_config
        first = kv_caches[0]
        dtype = getattr(torch, extra["dtype"]) if "dtype" in extra else first.dtype
        shape = (2, self.num_slots, *first.shape[2:])
        per_layer = 1
        for size in shape:
            per_layer *= size
        if "path" in extra:
            numel = per_layer * len(kv_caches)
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            self.store_file = open_store_file(self._store_path(str(extra["path"])), nbytes)
            flat = torch.frombuffer(self.store_file.mapping, dtype=dtype, count=numel)
        else:
            flat = torch.zeros(per_layer * len(kv_caches), dtype=dtype)
        self.store = [flat[i * per_layer:(i + 1) * per_layer].view(shape) for i in range(len(kv_caches))]

    def _store_path(self, path: str) -> str:
        """``path`` for the first rank of every kind; ``path.dp<d>.tp<t>`` for the others
        (each rank keeps its own KV heads, each data-parallel core its own blocks)."""
        from microvllm.distributed.parallel_state import get_tp_group

        parallel = self.config.parallel_config
        dp_rank, tp_rank = parallel.data_parallel_rank, get_tp_group().rank_in_group
        return path if dp_rank == 0 and tp_rank == 0 else f"{path}.dp{dp_rank}.tp{tp_rank}"

    def _turn_off(self, what: str, error: BaseException) -> None:
        """The one warning; every later copy is skipped."""
        if self.failed is None:
            self.failed = error
            where = f" ({self.store_file.path})" if self.store_file is not None else ""
            logger.warning("the OffloadingConnector's KV tier%s failed to %s (%s: %s): the tier is off from now "
                           "on and the server goes on without it (prompts it held are computed again); "
                           "restart with a kv_connector_extra_config path on a filesystem with room, or "
                           "without kv_transfer_config", where, what, type(error).__name__, error)

    def _copy_to_store(self, block_ids: tuple[int, ...], slots: tuple[int, ...]) -> None:
        """cache -> store, every layer (the save)."""
        for kv_cache, store in zip(self.kv_caches, self.store):
            ids = torch.tensor(block_ids, device=kv_cache.device)
            store[:, list(slots)] = kv_cache[:, ids].to(device=store.device, dtype=store.dtype)

    def _copy_from_store(self, block_ids: tuple[int, ...], slots: tuple[int, ...]) -> None:
        """store -> cache, every layer (the load)."""
        for kv_cache, store in zip(self.kv_caches, self.store):
            ids = torch.tensor(block_ids, device=kv_cache.device)
            kv_cache[:, ids] = store[:, list(slots)].to(device=kv_cache.device, dtype=kv_cache.dtype)

    def _metadata(self) -> OffloadingConnectorMetadata:
        metadata = self._get_connector_metadata()
        return metadata if isinstance(metadata, OffloadingConnectorMetadata) else OffloadingConnectorMetadata()

    def start_load_kv(self, **kwargs: Any) -> None:
        """Copy this step's loads, store -> cache, every layer, before the forward. What a
        failed step left in the finished sets is dropped: its scheduler side forgot it."""
        self._finished_sending, self._finished_recving = set(), set()
        self._failed_sending, self._failed_recving = set(), set()
        for request_id, (block_ids, slots) in self._metadata().reqs_to_load.items():
            if self.failed is None:
                try:
                    self._copy_from_store(block_ids, slots)
                except Exception as error:  # noqa: BLE001 - the tier goes, not the server
                    self._turn_off("load", error)
            if self.failed is None:
                self._finished_recving.add(request_id)
            else:   # the tier is off: the request computes these tokens instead
                self._failed_recving.add(request_id)

    def wait_for_save(self) -> None:
        """Copy this step's saves, cache -> store, every layer, after the forward. A save
        that fails turns the tier off; it (and every later one) is reported finished, so
        the blocks are freed, and failed, so the scheduler side does not count it stored."""
        for request_id, (block_ids, slots) in self._metadata().reqs_to_store.items():
            if self.failed is None:
                try:
                    self._copy_to_store(block_ids, slots)
                except Exception as error:  # noqa: BLE001 - the tier goes, not the server
                    self._turn_off("save", error)
            self._finished_sending.add(request_id)
            if self.failed is not None:
                self._failed_sending.add(request_id)

    def get_finished(self, finished_req_ids: frozenset[str] | set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._finished_sending or None, self._finished_recving or None
        self._finished_sending, self._finished_recving = set(), set()
        return sending, recving

    def get_failed_recving(self) -> set[str] | None:
        failed, self._failed_recving = self._failed_recving or None, set()
        return failed

    def get_failed_sending(self) -> set[str] | None:
        failed, self._failed_sending = self._failed_sending or None, set()
        return failed
