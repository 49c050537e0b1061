"""Worker: loads the model onto the platform's device, allocates the paged KV cache,
owns the model runner.

KV cache, one tensor per layer (block 0 is the null block, never written)::

    kv_caches[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]

    bytes per block = layers x 2 x block_size x num_kv_heads x head_dim x dtype size

With tensor parallelism each rank's worker holds only its own KV heads
(``num_kv_heads`` per rank), in the same number of blocks on every rank: the
scheduler's block ids are global.

The engine decides how many blocks (``Engine._initialize_kv_caches``, as vLLM's
``EngineCore``); the worker says what one costs and allocates them. On a GPU it also
measures what is left for them (``profile_memory``: ``worker/gpu_memory.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from microvllm.attention.selector import get_attention_backend
from microvllm.config import component, resolve_dtype
from microvllm.distributed.parallel_state import CommunicationStats, get_tp_group
from microvllm.models.loader import load_model
from microvllm.platforms import Platform
from microvllm.sample.on_device import place_sampler_on
from microvllm.sample.sampler import Sampler
from microvllm.worker.block_table import BlockTable
from microvllm.worker.gpu_memory import MemoryProfile
from microvllm.worker.model_runner import ModelRunner
from microvllm.worker.profile_run import profile_run


class Worker:
    def __init__(self, config, model_path, eos_token_ids: set[int], platform: Platform, hf_config=None):
        self.config, self.platform, self.eos_token_ids = config, platform, eos_token_ids
        self.dtype = resolve_dtype(config.dtype)
        self.backend = get_attention_backend(config.attention_backend)
        on_gpu = platform.device.type == "cuda"
        # Read before anything of ours is on the GPU: memory others hold is not ours to use
        # (empty_cache first: blocks torch keeps cached from freed tensors count as free).
        if on_gpu:
            torch.cuda.empty_cache()
        self.free_bytes_at_start = torch.cuda.mem_get_info()[0] if on_gpu else None
        # (another engine in this process already counts in neither: it is not free, and
        # the peak below is measured from what was allocated before this one started)
        self.allocated_bytes_at_start = torch.cuda.memory_allocated() if on_gpu else 0
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        self.model, self.hf_config = load_model(model_path, self.backend, dtype=config.dtype,
                                                device=platform.device, hf_config=hf_config)
        # The platform's versions of the ops (packed weights, C++ kernels), chosen once.
        platform.process_weights_after_loading(self.model)
        self.kv_caches: list[torch.Tensor] = []
        self.model_runner: ModelRunner | None = None

    def kv_cache_bytes_per_block(self) -> int:
        attn = self.model.layers[0].self_attn
        per_token = 2 * attn.num_kv_heads * attn.head_dim * torch.finfo(self.dtype).bits // 8
        return len(self.model.layers) * self.config.block_size * per_token

    def profile_memory(self) -> MemoryProfile:
        """Run the profiling pass (the largest batch) and read the GPU's memory."""
        config, attn = self.config, self.model.layers[0].self_attn
        profile_run(self.model, num_tokens=config.max_num_batched_tokens,
                    max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                    block_size=config.block_size, num_kv_heads=attn.num_kv_heads,
                    head_dim=attn.head_dim, dtype=self.dtype, device=self.platform.device)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - self.allocated_bytes_at_start
        torch.cuda.empty_cache()
        return MemoryProfile(total_bytes=torch.cuda.mem_get_info()[1],
                             free_bytes_at_start=self.free_bytes_at_start, peak_bytes=peak)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks per layer, then build the runner over them."""
        config, attn = self.config, self.model.layers[0].self_attn
        shape = (2, num_blocks, config.block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.platform.device)
                          for _ in self.model.layers]
        self.model_runner = component(config, "model_runner", ModelRunner)(
            self.model, self.kv_caches, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, eos_token_ids=self.eos_token_ids,
            seed=config.seed, sampler_class=component(config, "sampler", Sampler),
            block_table_class=component(config, "block_table", BlockTable),
            decode_step_runner=self.platform.decode_step_runner(
                self.model, max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len),
            # (only off the CPU: an exercise's ModelRunner need not know about devices)
            **({"device": self.platform.device} if self.platform.device.type != "cpu" else {}))
        if self.platform.device.type != "cpu":
            place_sampler_on(self.model_runner.sampler, self.platform.device, config.seed)
        self.platform.process_weights_after_loading(self.model_runner.sampler)

    def execute_model(self, scheduler_output):
        return self.model_runner.execute_model(scheduler_output)

    def communication_stats(self) -> CommunicationStats:
        """This rank's collectives so far: time, count, bytes (all zero in one process)."""
        return dataclasses.replace(get_tp_group().stats)
