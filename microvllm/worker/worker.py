"""Worker: loads the model onto the platform's device, allocates the paged KV cache,
owns the model runner.

KV cache, one tensor per layer (block 0 is the null block, never written)::

    kv_caches[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]

    bytes per block = layers x 2 x block_size x num_kv_heads x head_dim x dtype size

(A hybrid's layers share tensors, a block being a page of each: ``layers`` is then the
number of tensors, ``models/kv_cache_layout.py``.)

With tensor parallelism each rank's worker holds only its own KV heads
(``num_kv_heads`` per rank), in the same number of blocks on every rank: the
scheduler's block ids are global.

The worker says what one block costs and how many fit (``determine_num_kv_blocks``: the
platform measures: on a GPU after a profiling pass, ``platforms/gpu_memory.py``); the
engine decides how many to use (``Engine._initialize_kv_caches``, as vLLM's
``EngineCore``), and the worker allocates them.
"""

from __future__ import annotations

import dataclasses

import torch

from microvllm.attention.selector import get_attention_backend
from microvllm.config import EngineConfig
from microvllm.config.components import component
from microvllm.distributed.kv_transfer.kv_connector.base import KVConnectorBase, KVConnectorRole
from microvllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from microvllm.distributed.parallel_state import CommunicationStats, get_tp_group
from microvllm.layers.fused_moe.layer import moe_layers, take_expert_load
from microvllm.models.loader import load_model
from microvllm.platforms import Platform
from microvllm.sample.rejection_sampler import RejectionSampler
from microvllm.sample.sampler import Sampler
from microvllm.spec_decode.draft_model import DraftModelProposer, LayerSkipDraft
from microvllm.spec_decode.ngram_proposer import NgramProposer
from microvllm.worker.block_table import BlockTable
from microvllm.worker.kv_connector_model_runner_mixin import kv_connector_step
from microvllm.worker.model_runner import ModelRunner
from microvllm.worker.profile_run import profile_run


class Worker:
    def __init__(self, config: EngineConfig, eos_token_ids: set[int], platform: Platform,
                 components: dict[str, type] | None = None):
        self.config, self.platform, self.eos_token_ids = config, platform, eos_token_ids
        self.components = components
        model_config = config.model_config
        self.dtype = model_config.torch_dtype
        self.backend = get_attention_backend(config.device_config.attention_backend)
        self.memory_at_start = platform.memory_at_start()   # before anything of ours is loaded
        self.model, self.hf_config = load_model(model_config.model_path, self.backend, dtype=model_config.dtype,
                                                device=platform.device, hf_config=model_config.hf_config,
                                                quantization=model_config.quantization)
        # The platform's versions of the ops (packed weights, C++ kernels), chosen once.
        platform.process_weights_after_loading(self.model)
        self.kv_caches: list[torch.Tensor] = []
        self.model_runner: ModelRunner | None = None
        self.kv_connector: KVConnectorBase | None = None   # its worker side (kv_transfer_config)

    def kv_cache_bytes_per_block(self) -> int:
        num_kv_heads, head_dim = self.model.attention_dims()
        per_token = 2 * num_kv_heads * head_dim * torch.finfo(self.dtype).bits // 8
        return self.model.layout.num_kv_buffers * self.config.cache_config.block_size * per_token

    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit, as the platform measures it: on a CPU the byte budget;
        on a GPU what a profiling pass of the largest batch leaves (vLLM:
        ``Worker.determine_available_memory``)."""
        return self.platform.num_kv_blocks_that_fit(self.config.cache_config, self.kv_cache_bytes_per_block(),
                                                    self.profile_run, self.memory_at_start)

    def profile_run(self):
        """One forward of the largest batch the scheduler may send (``worker/profile_run.py``)."""
        scheduler, (num_kv_heads, head_dim) = self.config.scheduler_config, self.model.attention_dims()
        return profile_run(self.model, num_tokens=scheduler.max_num_batched_tokens,
                           max_num_seqs=scheduler.max_num_seqs, max_model_len=scheduler.max_model_len,
                           block_size=self.config.cache_config.block_size, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, dtype=self.dtype, device=self.platform.device)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks per layer, then build the runner over them."""
        block_size, scheduler = self.config.cache_config.block_size, self.config.scheduler_config
        components, layout = self.components, self.model.layout
        shape = (2, num_blocks, block_size, *self.model.attention_dims())
        # One tensor per layer, but in a hybrid, where layers of different groups share
        # tensors (models/kv_cache_layout.py): a block is a page of every tensor.
        buffers = [self.platform.allocate_kv_cache(shape, self.dtype) for _ in range(layout.num_kv_buffers)]
        self.kv_caches = [buffers[layout.layer_to_buffer[i]] for i in range(len(self.model.layers))]
        self.model_runner = component(components, "model_runner", ModelRunner)(
            self.model, self.kv_caches, block_size=block_size,
            max_num_seqs=scheduler.max_num_seqs, max_num_batched_tokens=scheduler.max_num_batched_tokens,
            max_model_len=scheduler.max_model_len, eos_token_ids=self.eos_token_ids,
            seed=self.config.model_config.seed, sampler_class=component(components, "sampler", Sampler),
            block_table_class=component(components, "block_table", BlockTable),
            decode_step_runner=self.platform.decode_step_runner(
                self.model, max_num_seqs=scheduler.max_num_seqs, max_model_len=scheduler.max_model_len),
            device=self.platform.device, drafter=self._make_drafter(num_blocks),
            rejection_sampler_class=component(components, "rejection_sampler", RejectionSampler),
            disable_by_batch_size=getattr(self.config.speculative_config, "disable_by_batch_size", None),
            lora_config=self.config.lora_config)
        self.platform.process_weights_after_loading(self.model_runner.sampler)
        if self.config.kv_transfer_config is not None:
            self.kv_connector = KVConnectorFactory.create_connector(
                self.config, KVConnectorRole.WORKER, num_blocks, self.model.layout.kv_cache_specs(block_size))
            self.kv_connector.register_kv_caches(self.kv_caches)
        self.moe_layers = moe_layers(self.model)   # {} for a dense model
        take_expert_load(self.moe_layers)          # forget what the profile run routed

    def _make_drafter(self, num_blocks: int):
        """The speculative config's proposer (None when speculative decoding is off)."""
        config = self.config.speculative_config
        if config is None:
            return None
        if config.method == "ngram":
            assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
            return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens)
        if config.method == "layer_skip":   # the target's first layers, on the target's cache
            assert config.num_draft_layers is not None
            return DraftModelProposer(LayerSkipDraft(self.model, config.num_draft_layers),
                                      self.kv_caches[:config.num_draft_layers], config.num_speculative_tokens,
                                      shares_target_kv=True)
        # A separate draft model: loaded as the target is, with its own cache over the same
        # block ids (so the scheduler's block tables serve both). Its cache is not counted
        # in the KV budget: it adds (its layers x its KV heads) / the target's to the cache.
        assert config.model is not None
        draft, _ = load_model(config.model, self.backend, dtype=self.config.model_config.dtype,
                              max_position=self.config.scheduler_config.max_model_len, device=self.platform.device)
        self.platform.process_weights_after_loading(draft)
        attn = draft.layers[0].self_attn
        shape = (2, num_blocks, self.config.cache_config.block_size, attn.num_kv_heads, attn.head_dim)
        self.draft_kv_caches = [self.platform.allocate_kv_cache(shape, self.dtype) for _ in draft.layers]
        return DraftModelProposer(draft, self.draft_kv_caches, config.num_speculative_tokens,
                                  shares_target_kv=False)

    def execute_model(self, scheduler_output):
        if self.kv_connector is None:
            output = self.model_runner.execute_model(scheduler_output)
        else:   # the connector's worker side around the forward (its loads before, saves after)
            with kv_connector_step(self.kv_connector, scheduler_output, self.kv_caches) as kv_output:
                output = self.model_runner.execute_model(scheduler_output)
            output.kv_connector_output = kv_output
        # Mixture-of-experts layers count what their routers chose: this step's counts
        # travel with its output (the step trace, LLM.get_metrics()).
        output.expert_load = take_expert_load(self.moe_layers)
        return output

    def communication_stats(self) -> CommunicationStats:
        """This rank's collectives so far: time, count, bytes (all zero in one process)."""
        return dataclasses.replace(get_tp_group().stats)
