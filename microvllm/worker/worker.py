"""Worker: loads the model onto the platform's device, allocates the paged KV cache,
owns the model runner.

KV cache, one tensor per layer (block 0 is the null block, never written)::

    kv_caches[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]

    bytes per block = layers x 2 x block_size x num_kv_heads x head_dim x dtype size

The engine decides how many blocks (``Engine._initialize_kv_caches``, as vLLM's
``EngineCore``); the worker says what one costs and allocates them.
"""

from __future__ import annotations

import torch

from microvllm.attention.selector import get_attention_backend
from microvllm.config import component, resolve_dtype
from microvllm.models.loader import load_model
from microvllm.platforms import Platform
from microvllm.sample.sampler import Sampler
from microvllm.worker.block_table import BlockTable
from microvllm.worker.model_runner import ModelRunner


class Worker:
    def __init__(self, config, model_path, eos_token_ids: set[int], platform: Platform):
        self.config, self.platform, self.eos_token_ids = config, platform, eos_token_ids
        self.dtype = resolve_dtype(config.dtype)
        self.backend = get_attention_backend(config.attention_backend)
        self.model, self.hf_config = load_model(model_path, self.backend, dtype=config.dtype,
                                                device=platform.device)
        # The platform's versions of the ops (packed weights, C++ kernels), chosen once.
        platform.process_weights_after_loading(self.model)
        self.kv_caches: list[torch.Tensor] = []
        self.model_runner: ModelRunner | None = None

    def kv_cache_bytes_per_block(self) -> int:
        attn = self.model.layers[0].self_attn
        per_token = 2 * attn.num_kv_heads * attn.head_dim * torch.finfo(self.dtype).bits // 8
        return len(self.model.layers) * self.config.block_size * per_token

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
            decode_step_runner=self.platform.decode_step_runner(self.model))
        self.platform.process_weights_after_loading(self.model_runner.sampler)

    def execute_model(self, scheduler_output):
        return self.model_runner.execute_model(scheduler_output)
