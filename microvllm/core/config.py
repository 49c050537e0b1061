"""SchedulerConfig: the knobs of continuous batching, checked at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of the scheduler.

    max_num_seqs            most requests in the running batch at once
    max_num_batched_tokens  token budget of one step (prefill chunks + decodes)
    max_model_len           most tokens (prompt + output) a request may reach;
                            positions 0 .. max_model_len-1 are ever computed
    enable_chunked_prefill  split long prompts over several steps; when False a
                            prompt is scheduled whole or waits
    async_scheduling        plan step N+1 while step N's forward runs (AsyncScheduler)
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} is {value!r}: it must be a positive integer")
