"""A sampler on a GPU: its shared generator there, and each step's ``SamplingMetadata``
(built on the CPU, as the model runner builds it) moved to where the logits are.

The worker calls ``place_sampler_on`` once, off the CPU; on a CPU nothing changes.
It works for any ``Sampler`` class (an exercise's too), through a forward pre-hook,
so ``Sampler.forward`` and ``Sampler.sample`` stay as the course shows them.
"""

from __future__ import annotations

import torch

from microvllm.sample.metadata import make_generator


def place_sampler_on(sampler: torch.nn.Module, device: torch.device | str, seed: int | None) -> None:
    device = torch.device(device)
    sampler.generator = make_generator(seed, device)

    def metadata_to_logits_device(module, args):
        logits, sampling_metadata, *rest = args
        return (logits, sampling_metadata.to(logits.device), *rest)

    sampler.register_forward_pre_hook(metadata_to_logits_device)
