"""What the user gets back (vLLM's names): one ``RequestOutput`` per prompt, holding
one ``CompletionOutput`` per sample (``SamplingParams.n``).

Logprobs come as vLLM returns them: per position a dict from token id to ``Logprob``,
the token actually there first, then the top N::

    completion.logprobs[step]   {791: Logprob(logprob=-0.28, rank=1, decoded_token='The'),
                                 362: Logprob(logprob=-2.44, rank=2, decoded_token='A'), ...}
    request.prompt_logprobs     [None, {id of prompt token 1: Logprob(...), top N...}, ...]
                                 (the first prompt token has no logprob: nothing predicts it)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token at one position (``vllm.logprobs.Logprob``).

    rank: 1 for the most likely token of the vocabulary, 2 for the next, ...
    decoded_token: the token's own text (special tokens included).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token; for the prompt, None at the first position.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or token that ended it
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    delta_text: str = ""                  # text added by the latest step (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0           # prompt tokens served from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None             # why it failed, when finish_reason is "error"
    bad_request: bool = False            # ... and the request itself is at fault (its grammar): a 400
    kv_transfer_params: dict | None = None   # a KV connector's, when finished (disaggregated prefill)

    def __repr__(self) -> str:
        texts = [o.text[:40] for o in self.outputs]
        return (f"RequestOutput(request_id={self.request_id!r}, finished={self.finished}, "
                f"texts={texts}, finish_reasons={[o.finish_reason for o in self.outputs]})")
