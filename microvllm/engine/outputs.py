"""What the user gets back (vLLM's names): one ``RequestOutput`` per prompt, holding
one ``CompletionOutput`` per sample (``SamplingParams.n``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None     # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token that ended it
    logprobs: list[dict[int, float]] | None = None
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

    def __repr__(self) -> str:
        texts = [o.text[:40] for o in self.outputs]
        return (f"RequestOutput(request_id={self.request_id!r}, finished={self.finished}, "
                f"texts={texts}, finish_reasons={[o.finish_reason for o in self.outputs]})")
