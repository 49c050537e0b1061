"""Sampling: from logits to the next token of every request in the batch.

    metadata.py           SamplingParams of a step -> batched tensors (+ make_generator)
    sampler.py            Sampler: greedy / random paths, logprobs -> SamplerOutput
    topk_topp_sampler.py  top-k, top-p, min-p filters and the seeded random draw
    penalties.py          min_tokens; repetition / frequency / presence penalties
    logprobs.py           raw log-probabilities of the top-N and the sampled token; prompt logprobs
"""

from microvllm.sample.logprobs import LogprobsTensors
from microvllm.sample.metadata import SamplingMetadata, make_generator
from microvllm.sample.penalties import apply_min_tokens_penalty
from microvllm.sample.sampler import Sampler, SamplerOutput

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata",
           "apply_min_tokens_penalty", "make_generator"]
