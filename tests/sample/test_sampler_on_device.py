"""The sampler off the CPU (sample/on_device.py): each step's ``SamplingMetadata`` follows
the logits to their device, and the shared generator is made there from the seed."""

import torch

from microvllm.sample.metadata import SamplingMetadata
from microvllm.sample.on_device import place_sampler_on
from microvllm.sample.sampler import Sampler
from microvllm.sampling_params import SamplingParams


def test_to_moves_tensors_and_keeps_generators():
    generator = torch.Generator().manual_seed(3)
    params = [SamplingParams(temperature=0.7, top_k=5, seed=3), SamplingParams(temperature=0.0)]
    metadata = SamplingMetadata.from_params(params, [generator, None])
    assert metadata.to("cpu") is metadata
    on_meta = metadata.to("meta")
    assert on_meta.temperature.device.type == "meta" and on_meta.top_k.device.type == "meta"
    assert on_meta.generators == {0: generator} and metadata.temperature.device.type == "cpu"


def test_the_sampler_moves_each_steps_metadata_to_the_logits():
    class Built:  # stands in for metadata built on the CPU, logits elsewhere
        def to(self, device):
            return ("moved to", torch.device(device))

    sampler = Sampler(seed=0)
    place_sampler_on(sampler, "cpu", seed=1)
    sampler.forward = lambda logits, sampling_metadata: sampling_metadata  # what forward receives
    assert sampler(torch.zeros(1, 4), Built()) == ("moved to", torch.device("cpu"))


def test_the_shared_generator_is_made_anew_from_the_seed():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9)]
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    want = Sampler(seed=1)(logits, SamplingMetadata.from_params(params)).sampled_token_ids
    sampler = Sampler(seed=0)
    place_sampler_on(sampler, "cpu", seed=1)
    assert torch.equal(sampler(logits, SamplingMetadata.from_params(params)).sampled_token_ids, want)
