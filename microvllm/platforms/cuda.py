"""``CudaPlatform``: the engine on one NVIDIA GPU (vLLM: ``vllm/platforms/cuda.py``).

    device                       cuda (weights, KV cache, inputs, samplers' generators)
    default_dtype                bfloat16 (the checkpoints' precision; the GPU's matrix units)
    default attention backend    "triton": the unified kernel of notebook 06, compiled
    ops (CustomOp)               forward_native everywhere: torch's own CUDA kernels
    decode_step_runner           CUDAGraphWrapper (cuda_graph.py); none with enforce_eager
    the KV cache's size          gpu_memory_utilization of the free memory, less the
                                 profiling pass's peak (gpu_memory.py draws it)
    several ranks                NCCL, one GPU per rank
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from microvllm.attention.triton_backend import TritonAttentionBackend
from microvllm.config import DEFAULT_GPU_MEMORY_UTILIZATION
from microvllm.platforms.cuda_graph import CUDAGraphWrapper
from microvllm.platforms.gpu_memory import MemoryAtStart, MemoryProfile, num_gpu_blocks
from microvllm.platforms.interface import Platform
from microvllm.platforms.padded_decode_batch import cudagraph_capture_sizes

logger = logging.getLogger(__name__)


class CudaPlatform(Platform):
    name = "cuda"
    device = torch.device("cuda")
    default_dtype = "bfloat16"
    eager_attention_backend = "triton"   # Triton kernels are the notebooks' code: eager keeps them
    distributed_backend = "nccl"

    def default_attention_backend(self) -> str:
        return "triton"

    def kv_cache_budget(self, kv_cache_memory_bytes: int,
                        gpu_memory_utilization: float | None) -> tuple[int | None, float | None]:
        """vLLM's meaning: a fraction of the GPU's free memory (0.9 by default)."""
        if gpu_memory_utilization is None:
            gpu_memory_utilization = DEFAULT_GPU_MEMORY_UTILIZATION
        return None, gpu_memory_utilization

    def memory_at_start(self) -> MemoryAtStart:
        """Read before anything of ours is on the GPU: memory others hold is not ours to use
        (empty_cache first: blocks torch keeps cached from freed tensors count as free).
        Another engine in this process counts in neither: it is not free, and the peak is
        measured from what was allocated before this one started."""
        torch.cuda.empty_cache()
        reading = MemoryAtStart(free_bytes=torch.cuda.mem_get_info()[0],
                                allocated_bytes=torch.cuda.memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        return reading

    def num_kv_blocks_that_fit(self, cache_config, bytes_per_block: int, profile_run: Callable[[], object],
                               memory_at_start: MemoryAtStart) -> int:
        """Run the profiling pass (the largest batch), read the GPU's memory, and leave the
        cache what the weights and the peak leave of ``gpu_memory_utilization``."""
        profile_run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - memory_at_start.allocated_bytes
        torch.cuda.empty_cache()
        profile = MemoryProfile(total_bytes=torch.cuda.mem_get_info()[1],
                                free_bytes_at_start=memory_at_start.free_bytes, peak_bytes=peak)
        return num_gpu_blocks(profile, cache_config.gpu_memory_utilization, bytes_per_block)

    def set_device(self, rank: int) -> None:
        torch.cuda.set_device(rank)   # one GPU per rank

    def check_attention_backend(self, name: str) -> None:
        if name == "cpu":
            raise ValueError("attention_backend='cpu' runs the CPU platform's C++ kernels, not on a "
                             "GPU: choose attention_backend='triton' (or 'auto'), or device='cpu'")

    def build_decode_step_runner(self, model: nn.Module, *, max_num_seqs: int = 1,
                                 max_model_len: int | None = None) -> Callable | None:
        """CUDA graphs for decode-only steps, when the attention backend can be captured (the
        Triton kernels read every per-step value from device tensors; the torch backends
        read Python lists)."""
        if getattr(model, "is_hybrid", False):
            # Each request's state is read and written page by page in Python (paged_state.py).
            logger.info("CUDA graphs off: a hybrid model's linear-attention layers loop over requests")
            return None
        backend = model.layers[0].self_attn.attn.backend
        if not isinstance(backend, TritonAttentionBackend):
            logger.info("CUDA graphs off: attention_backend=%r reads host values each step; "
                        "use attention_backend='triton' to capture decode steps", backend.name)
            return None
        if getattr(model, "is_mixture_of_experts", False):
            # Routing sizes are data-dependent: moe_align_block_size reads how many rows each
            # expert got on the host, which a captured graph cannot replay (vLLM pads to the
            # most rows possible and keeps the counts on the device).
            logger.info("CUDA graphs off: the mixture-of-experts layers size their work from "
                        "each step's routing")
            return None
        max_model_len = max_model_len or model.config.max_position_embeddings
        return CUDAGraphWrapper(model, cudagraph_capture_sizes(max_num_seqs), max_model_len=max_model_len)
