"""``CudaPlatform``: the engine on one NVIDIA GPU (vLLM: ``vllm/platforms/cuda.py``).

    device                       cuda (weights, KV cache, inputs, samplers' generators)
    default_dtype                bfloat16 (the checkpoints' precision; the GPU's matrix units)
    default attention backend    "triton": the unified kernel of notebook 06, compiled
    ops (CustomOp)               forward_native everywhere: torch's own CUDA kernels
    decode_step_runner           CUDAGraphWrapper (cuda_graph.py); none with enforce_eager

The KV cache is sized from the GPU's memory (``worker/gpu_memory.py``).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from microvllm.attention.triton_backend import TritonAttentionBackend
from microvllm.platforms.cuda_graph import CUDAGraphWrapper
from microvllm.platforms.interface import Platform
from microvllm.platforms.padded_decode_batch import cudagraph_capture_sizes

logger = logging.getLogger(__name__)


class CudaPlatform(Platform):
    name = "cuda"
    device = torch.device("cuda")
    default_dtype = "bfloat16"

    def default_attention_backend(self) -> str:
        return "triton"

    def check_attention_backend(self, name: str) -> None:
        if name == "cpu":
            raise ValueError("attention_backend='cpu' runs the CPU platform's C++ kernels, not on a "
                             "GPU: choose attention_backend='triton' (or 'auto'), or device='cpu'")

    def decode_step_runner(self, model: nn.Module, *, max_num_seqs: int = 1,
                           max_model_len: int | None = None) -> Callable | None:
        """CUDA graphs for decode-only steps, when the attention backend can be captured (the
        Triton kernels read every per-step value from device tensors; the torch backends
        read Python lists), and ``enforce_eager`` is off."""
        if self.enforce_eager:
            return None
        backend = model.layers[0].self_attn.attn.backend
        if not isinstance(backend, TritonAttentionBackend):
            logger.info("CUDA graphs off: attention_backend=%r reads host values each step; "
                        "use attention_backend='triton' to capture decode steps", backend.name)
            return None
        max_model_len = max_model_len or model.config.max_position_embeddings
        return CUDAGraphWrapper(model, cudagraph_capture_sizes(max_num_seqs), max_model_len=max_model_len)
