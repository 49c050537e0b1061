"""Platforms: what depends on the hardware, chosen once per engine.

    interface.py           Platform: device, default dtype and attention backend, the KV
                           cache's size, the ops' fast versions, the decode-step runner,
                           the collective backend
    cpu/                   CpuPlatform and everything speed-only on a CPU: the C++ kernels
                           (built from microvllm/csrc/), packed GEMMs, the CPU attention
                           backend, the decode fast path
    cuda.py                CudaPlatform: the Triton kernels compiled, CUDA graphs for decode
    cuda_graph.py          CUDAGraphWrapper: capture a decode step once per batch size, replay
    padded_decode_batch.py the capture sizes and the padding of a decode batch to one of them
                           (no CUDA in it: tested on a CPU)
    gpu_memory.py          how many KV blocks fit on a GPU, from its memory readings

The lesson path (core, engine, worker, models, layers, attention's reference and Triton
kernels, sampler) never imports this package's kernels; ``LLM(enforce_eager=True)`` runs
it with none of them loaded.
"""

from microvllm.config import DEVICES
from microvllm.platforms.interface import Platform


def resolve_device(device: str, cuda_available: bool) -> str:
    """``"auto"`` -> ``"cuda"`` where a CUDA GPU is present, else ``"cpu"``; ``"cuda"``
    without one is refused, saying what to change::

        device   CUDA GPU?   result
        auto     yes         cuda
        auto     no          cpu
        cpu      -           cpu
        cuda     yes         cuda
        cuda     no          error: no GPU here
    """
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not supported; choose one of {DEVICES}")
    if device == "auto":
        return "cuda" if cuda_available else "cpu"
    if device == "cuda" and not cuda_available:
        raise ValueError("device='cuda' but torch sees no CUDA GPU here (torch.cuda.is_available() "
                           "is False): use device='cpu' or 'auto', or install a CUDA build of torch "
                           "on a machine with an NVIDIA GPU (on Colab: Runtime > Change runtime type > GPU)")
    return device


def get_platform(device: str = "cpu", enforce_eager: bool = False) -> Platform:
    """The platform for ``device``: ``"cpu"``, ``"cuda"`` or ``"auto"`` (see ``resolve_device``)."""
    import torch

    device = resolve_device(device, torch.cuda.is_available())
    if device == "cuda":
        from microvllm.platforms.cuda import CudaPlatform
        return CudaPlatform(enforce_eager=enforce_eager)
    from microvllm.platforms.cpu.platform import CpuPlatform
    return CpuPlatform(enforce_eager=enforce_eager)


def platform_for(device_config) -> Platform:
    """The platform a resolved ``DeviceConfig`` names (the engine's, and each worker
    process's): its device, and whether it runs the plain code (``enforce_eager``)."""
    return get_platform(device_config.device, enforce_eager=device_config.enforce_eager)


__all__ = ["DEVICES", "Platform", "get_platform", "platform_for", "resolve_device"]
