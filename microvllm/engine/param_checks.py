"""Checks of a request's ``SamplingParams`` against the model it will run on.

``SamplingParams`` checks every value on its own (a temperature is >= 0, top_p in
(0, 1]); what it cannot know is the model: how large the vocabulary is, and how many
logprobs this engine agreed to return. Those checks run here, at the door
(``Engine.process_request``), so that a value the sampler would choke on is a
``ValueError`` naming the field, never an exception inside an engine step (vLLM:
``v1/engine/processor.py``, ``_validate_logprobs`` and ``_validate_supported_sampling_params``)::

    logprobs, prompt_logprobs     <= max_logprobs (20 by default; -1: up to the vocabulary)
    stop_token_ids, allowed_token_ids, logit_bias keys     0 <= id < vocab_size
"""

from __future__ import annotations

from microvllm.sampling_params import SamplingParams


def check_params_for_model(params: SamplingParams, vocab_size: int | None, max_logprobs: int) -> None:
    """Raise ``ValueError`` (naming the field) for a value this model cannot honour."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and limit is not None and value > limit:
            what = "the vocabulary size" if max_logprobs == -1 else f"max_logprobs={max_logprobs}"
            raise ValueError(f"{name}={value} is more than {what} allows ({limit}): ask for at most "
                             f"{limit} (or start the engine with a larger max_logprobs)")
    if vocab_size is None:
        return
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        ids = getattr(params, name, None) or ()
        outside = [t for t in ids if not 0 <= t < vocab_size]
        if outside:
            raise ValueError(f"{name} contains token ids {outside[:5]} outside the vocabulary "
                             f"[0, {vocab_size}): every id must be 0 <= id < {vocab_size}")
