"""SpecDecodingStats: how many drafts the target accepted, by position (vLLM:
``vllm/v1/spec_decode/metrics.py``, whose counter names ``/metrics`` uses).

    num_drafts                    steps in which a request had drafts checked
    num_draft_tokens              draft tokens checked
    num_accepted_tokens           draft tokens accepted
    num_accepted_tokens_per_pos   [k]: how often draft j (0-based) was accepted; a draft
                                  counts only if every one before it was, so this falls
                                  with j, and its ratio to num_drafts is the acceptance
                                  rate at each depth

Mean tokens per step of a request with drafts = 1 + num_accepted_tokens / num_drafts.
Pure Python: the scheduler counts while it rolls back rejected drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's step: it checked ``num_draft_tokens`` drafts and kept the first
        ``num_accepted_tokens`` of them."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.extend([0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos)))
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / checked drafts (0.0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a request gains per step with drafts: 1 (the target's own) + accepted."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
