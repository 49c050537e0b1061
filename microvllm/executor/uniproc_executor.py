"""``UniProcExecutor``: one worker, in the engine's own process (``tensor_parallel_size=1``;
vLLM: ``vllm/v1/executor/uniproc_executor.py``). It only forwards: no process group, no
communication, so a breakpoint in the model is hit in this process."""

from __future__ import annotations

from microvllm.executor.abstract import Executor
from microvllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config, eos_token_ids: set[int], platform, components=None):
        self.worker = Worker(config, eos_token_ids, platform, components)

    @property
    def kv_cache_layout(self):
        return self.worker.model.layout

    def kv_cache_bytes_per_block(self) -> int:
        return self.worker.kv_cache_bytes_per_block()

    def collective_rpc(self, method: str, *args):
        """Run ``Worker.<method>(*args)`` on the one worker (vLLM's name)."""
        return getattr(self.worker, method)(*args)
