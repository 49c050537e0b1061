"""Property test: random sequences of cache operations never break the pool's accounting.

The hypothesis state machine is exercise 04's checker's own (``microvllm.checks.
kv_cache_machine``: one copy), run here on the engine's ``KVCacheManager`` with more
examples. It admits, grows, frees and preempts requests, touches and evicts cached
blocks, looks up prefixes and resets the cache, on pools of 1 to 64 blocks with
full-attention, sliding-window or both groups. After every operation:
``check_invariants()``. Every computed token is "written" to a shadow KV cache and every
key a query attends to is read back, so a wrong prefix hit or a block handed out twice
fails too.
"""

from hypothesis import HealthCheck, settings

from microvllm.checks.kv_cache_machine import kv_cache_machine

KVCacheMachine = type("KVCacheMachine", (kv_cache_machine(),), {})
KVCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestKVCacheStateMachine = KVCacheMachine.TestCase
