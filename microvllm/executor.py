"""Executor: the engine's handle on the workers. vLLM spreads a model over many GPUs
(tensor/pipeline parallel) behind this seam; microvllm has exactly one worker in
this process, so the executor only forwards — but the seam is kept so the engine
never touches a tensor."""

from __future__ import annotations

from microvllm.worker.worker import Worker


class Executor:
    def __init__(self, config, model_path, eos_token_ids: set[int], platform):
        self.worker = Worker(config, model_path, eos_token_ids, platform)

    @property
    def kv_cache_layout(self):
        return self.worker.model.layout

    def kv_cache_bytes_per_block(self) -> int:
        return self.worker.kv_cache_bytes_per_block()

    def profile_memory(self):
        return self.worker.profile_memory()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output):
        return self.worker.execute_model(scheduler_output)
