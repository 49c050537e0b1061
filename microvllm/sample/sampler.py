"""The Sampler: from one step's logits to one next token per request.

    logits [num_reqs, vocab] ──┬─> log_softmax ──────────────────────────> logprobs (raw)
                               └─> min_tokens: ban eos/stop ids; logit_bias,
                                   allowed_token_ids, bad words (logits_processors.py);
                                   the grammar bitmask (structured outputs)
                                   -> repetition / frequency / presence penalties
                                      ├─> argmax ─────────────────────────> greedy rows
                                      └─> / temperature -> top_k -> top_p
                                          -> min_p -> softmax -> draw ────> random rows
                                                              (RandomSample)
                                                                  │
    sampled_token_ids [num_reqs] <── where(row is greedy, greedy, random)

The whole batch goes through each stage at once (one tensor op per stage); the
only Python loop draws the noise of seeded rows from their own generators.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from microvllm.layers.custom_op import CustomOp
from microvllm.sample.logits_processors import apply_allowed_token_ids, apply_logit_bias
from microvllm.sample.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs
from microvllm.sample.metadata import SamplingMetadata, make_generator
from microvllm.sample.penalties import apply_min_tokens_penalty, apply_penalties
from microvllm.sample.topk_topp_sampler import apply_min_p, apply_top_k, apply_top_p, random_sample
from microvllm.sampling_params import SAMPLING_EPS
from microvllm.structured_output.bitmask import apply_bitmask


class Argmax(CustomOp):
    """Greedy sampling: each row's first largest logit (the first NaN, if a row has one),
    as ``torch.argmax``. A ``CustomOp``: a platform may do it faster (the CPU's kernel
    returns the same ids)."""

    def forward_native(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)


class RandomSample(CustomOp):
    """The random rows' draw: one token per row of ``probs``. ``forward_native`` is the
    draw it was built with (the Sampler's: ``random_sample``, the exponential race). A
    ``CustomOp``: a platform may draw from the same distributions its own way (the CPU's
    needs one random number per row instead of one per vocabulary entry,
    ``platforms/cpu/sampling.py``); then a seed still fixes the tokens, but not the same
    tokens as ``enforce_eager=True`` draws."""

    def __init__(self, draw):
        super().__init__()
        self.draw = draw

    def forward_native(self, probs: torch.Tensor, generators: dict[int, torch.Generator],
                       shared_generator: torch.Generator) -> torch.Tensor:
        return self.draw(probs, generators, shared_generator)


@dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor              # [num_reqs] int64
    logprobs_tensors: LogprobsTensors | None     # None when no request asked for logprobs


class Sampler(nn.Module):
    """Samples the next token of every row of a batch.

    ``seed`` seeds the shared generator used by requests without their own seed
    (the engine's ``seed``), so that a whole run is reproducible.
    """

    def __init__(self, seed: int | None = 0, device: str | torch.device = "cpu"):
        super().__init__()
        self.generator = make_generator(seed, device)
        self.argmax = Argmax()
        self.random_sample = RandomSample(random_sample)

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != sampling_metadata.num_reqs:
            raise ValueError(f"logits must be [num_reqs={sampling_metadata.num_reqs}, vocab_size], "
                             f"got shape {tuple(logits.shape)}: one row per request of this step")
        logits = logits.float()
        # Logprobs describe the model's own prediction: take them before any change.
        raw_logprobs = (compute_logprobs(logits)
                        if sampling_metadata.max_num_logprobs is not None else None)

        logits = self.apply_logits_processors(logits, sampling_metadata)
        sampled = self.sample(logits, sampling_metadata)

        logprobs_tensors = None
        if raw_logprobs is not None:
            logprobs_tensors = gather_logprobs(raw_logprobs, sampling_metadata.max_num_logprobs,
                                               sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
        """Every rule that changes a row's logits before the draw: min_tokens bans, logit_bias,
        allowed_token_ids, bad words, the grammar bitmask, then the penalties. Returns new
        logits when a rule applies (the caller's stay untouched), else ``logits`` itself.
        The rejection sampler of speculative decoding runs the same rules on each draft
        position. The caller takes the raw logprobs before this, so none of these rules,
        the grammar included, changes them (vLLM's default ``logprobs_mode``)."""
        m = sampling_metadata
        if (m.min_tokens_banned_ids or m.logit_bias or m.allowed_token_ids or m.bad_words_banned_ids
                or m.grammar_bitmask is not None):
            logits = logits.clone()
            apply_min_tokens_penalty(logits, m.min_tokens_banned_ids.items())
            apply_logit_bias(logits, m.logit_bias)
            apply_allowed_token_ids(logits, m.allowed_token_ids)
            apply_min_tokens_penalty(logits, m.bad_words_banned_ids.items())  # the same ban
            if m.grammar_bitmask is not None:   # forbidden ids -> -inf
                apply_bitmask(logits, m.grammar_bitmask, m.grammar_rows)
        if m.repetition_penalties is not None:  # greedy rows too, as in vLLM
            logits = apply_penalties(logits, m.prompt_token_ids, m.output_token_ids,
                                     m.presence_penalties, m.frequency_penalties, m.repetition_penalties)
        return logits

    def sample(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax; random rows are filtered and drawn."""
        ### BEGIN SOLUTION
        greedy_sampled = None
        if not sampling_metadata.all_random:
            # Exactly torch.argmax, as Hugging Face greedy search does: same ids.
            greedy_sampled = self.argmax(logits)
            if sampling_metadata.all_greedy:
                return greedy_sampled

        temperature = sampling_metadata.temperature
        is_greedy = temperature < SAMPLING_EPS
        # Greedy rows are computed too (it is one batched op) and discarded below;
        # dividing them by 1.0 instead of 0 keeps them finite.
        logits = logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(-1)
        if sampling_metadata.top_k is not None:
            logits = apply_top_k(logits, sampling_metadata.top_k)
        if sampling_metadata.top_p is not None:
            logits = apply_top_p(logits, sampling_metadata.top_p)
        if sampling_metadata.min_p is not None:
            logits = apply_min_p(logits, sampling_metadata.min_p)
        probs = logits.softmax(dim=-1)
        random_sampled = self.random_sample(probs, sampling_metadata.generators, self.generator)

        if greedy_sampled is None:
            return random_sampled
        return torch.where(is_greedy, greedy_sampled, random_sampled)
        ### END SOLUTION
