"""Platforms: what depends on the hardware, chosen once per engine.

    interface.py   Platform: device, default attention backend, the ops' fast versions,
                   the decode-step runner
    cpu/           CpuPlatform and everything speed-only on a CPU: the C++ kernels
                   (built from microvllm/csrc/), packed GEMMs, the CPU attention backend,
                   the decode fast path

The lesson path (core, engine, worker, models, layers, attention's reference and Triton
kernels, sampler) never imports this package's kernels; ``LLM(enforce_eager=True)`` runs
it with none of them loaded.
"""

from microvllm.platforms.interface import Platform


def get_platform(device: str = "cpu", enforce_eager: bool = False) -> Platform:
    """The platform for ``device`` (today: ``"cpu"``)."""
    if device == "cpu":
        from microvllm.platforms.cpu.platform import CpuPlatform
        return CpuPlatform(enforce_eager=enforce_eager)
    raise ValueError(f"device={device!r} is not supported; microvllm runs on 'cpu'")


__all__ = ["Platform", "get_platform"]
