"""Worker: loads the model, sizes and allocates the paged KV cache, owns the runner.

KV cache, one tensor per layer (block 0 is the null block, never written)::

    kv_caches[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]

    bytes per block = layers x 2 x block_size x num_kv_heads x head_dim x dtype size
"""

from __future__ import annotations

import logging

import torch

from microvllm.attention import get_attention_backend
from microvllm.attention.backend import resolve_backend_name
from microvllm.models.loader import load_model, resolve_dtype
from microvllm.config import component
from microvllm.sample.sampler import Sampler
from microvllm.worker.block_table import BlockTable
from microvllm.worker.model_runner import ModelRunner

logger = logging.getLogger("microvllm")


def kv_cache_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    attn = model.layers[0].self_attn
    per_token = 2 * attn.num_kv_heads * attn.head_dim * torch.finfo(dtype).bits // 8
    return len(model.layers) * block_size * per_token


class Worker:
    def __init__(self, config, model_path, eos_token_ids: set[int]):
        self.config = config
        # "auto" becomes the name it picks, so that reports show what actually runs.
        config.attention_backend = resolve_backend_name(config.attention_backend)
        self.backend = get_attention_backend(config.attention_backend)
        dtype = resolve_dtype(config.dtype)
        self.model, self.hf_config = load_model(model_path, self.backend, dtype=config.dtype,
                                                max_position=None)
        config.finalize(self.hf_config.max_position_embeddings)
        if config.num_kv_blocks is None:
            per_block = kv_cache_bytes_per_block(self.model, config.block_size, dtype)
            # No more than max_num_seqs requests of max_model_len tokens could ever use
            # (+1: the null block); a tiny model would otherwise get ~100k blocks.
            most_useful = config.max_num_seqs * -(-config.max_model_len // config.block_size) + 1
            config.num_kv_blocks = max(2, min(config.kv_cache_memory_bytes // per_block, most_useful))
            logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB, %s)",
                        config.num_kv_blocks, config.block_size,
                        (config.num_kv_blocks - 1) * config.block_size,
                        config.num_kv_blocks * per_block / 2**20, config.dtype)
        attn = self.model.layers[0].self_attn
        shape = (2, config.num_kv_blocks, config.block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in self.model.layers]
        self.model_runner = component(config, "model_runner", ModelRunner)(
            self.model, self.kv_caches, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, eos_token_ids=eos_token_ids,
            seed=config.seed, sampler_class=component(config, "sampler", Sampler),
            block_table_class=component(config, "block_table", BlockTable))

    def execute_model(self, scheduler_output):
        return self.model_runner.execute_model(scheduler_output)
