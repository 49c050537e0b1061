"""Sampling off the CPU: the model runner builds each step's ``SamplingMetadata`` on the
CPU and moves it, explicitly, to the logits' device (``SamplingMetadata.to``); the
sampler itself stays as the course shows it."""

import torch

from microvllm.sample.metadata import SamplingMetadata
from microvllm.sampling_params import SamplingParams


def test_to_moves_tensors_and_keeps_generators():
    generator = torch.Generator().manual_seed(3)
    params = [SamplingParams(temperature=0.7, top_k=5, seed=3), SamplingParams(temperature=0.0)]
    metadata = SamplingMetadata.from_params(params, [generator, None])
    assert metadata.to("cpu") is metadata
    on_meta = metadata.to("meta")
    assert on_meta.temperature.device.type == "meta" and on_meta.top_k.device.type == "meta"
    assert on_meta.generators == {0: generator} and metadata.temperature.device.type == "cpu"
