"""microvllm.core: the pure-Python brain of the engine (no torch, no device).

    request.py                  Request, RequestStatus
    kv_cache_utils.py           KVCacheBlock, FreeKVCacheBlockQueue, prefix hashing
    block_pool.py               BlockPool: ref counts, LRU free queue, hash -> block
    kv_cache_spec.py            FullAttentionSpec, SlidingWindowSpec, MambaSpec (cache groups)
    single_type_kv_cache_manager.py   one group's block tables
    kv_cache_manager.py         KVCacheManager: the scheduler's door to the cache
    kv_cache_invariants.py      check_invariants() and InvariantError
    config.py                   SchedulerConfig
    sched_output.py             SchedulerOutput: the immutable plan for the runner
    scheduler.py                Scheduler: continuous batching, chunked prefill, preemption
    scheduler_invariants.py     the scheduler's check_invariants()
    stop_conditions.py          check_stop
    outputs.py                  EngineCoreOutput, KVConnectorOutput
    kv_connector_protocol.py    SchedulerConnector: the KV connector calls the scheduler makes
"""

from microvllm.core.block_pool import BlockPool
from microvllm.core.config import SchedulerConfig
from microvllm.core.kv_cache_invariants import InvariantError
from microvllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, PoolTooSmallError
from microvllm.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from microvllm.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens
from microvllm.core.outputs import EngineCoreOutput
from microvllm.core.request import Request, RequestStatus
from microvllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from microvllm.core.scheduler import Scheduler

__all__ = [
    "BlockHash", "BlockPool", "CachedRequestData", "EngineCoreOutput", "FreeKVCacheBlockQueue",
    "FullAttentionSpec", "InvariantError", "KVCacheBlock", "KVCacheBlocks", "KVCacheManager",
    "KVCacheSpec", "NewRequestData", "PoolTooSmallError", "Request", "RequestStatus", "Scheduler",
    "MambaSpec", "SchedulerConfig", "SchedulerOutput", "SlidingWindowSpec", "hash_block_tokens",
]
