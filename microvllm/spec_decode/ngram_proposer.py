"""NgramProposer: draft tokens by prompt lookup, no model at all (vLLM:
``vllm/v1/spec_decode/ngram_proposer.py``).

Text that quotes, edits or summarizes a given text repeats it. If the request's last n
tokens appeared before, guess that what followed them then follows again::

    tokens   ... the cat sat on the mat . Then the cat sat on | ?
                     ^^^^^^^^^^^^^^ earlier match of the last n = 4 tokens
    drafts                       the mat . Then              (k = 4 tokens that followed)

Longer suffixes are tried first (``prompt_lookup_max`` down to ``prompt_lookup_min``): a
long match is better evidence. Among matches of the same length the latest wins (the
nearest context). No match: no drafts, and the step is a plain decode step.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Prompt-lookup drafter: ``propose_for(token_ids)`` -> up to k draft tokens."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.k = num_speculative_tokens

    def after_target_forward(self, inputs) -> None:
        """Nothing to do: the drafts come from the tokens alone (a draft model catches up here)."""

    def propose(self, runner, states, max_drafts: list[int]) -> list[list[int]]:
        """Drafts for each request that just sampled (``states``: the runner's
        ``CachedRequestState``; ``max_drafts``: the most each may get). The model runner
        calls this after sampling (vLLM: ``propose_draft_token_ids``)."""
        return [self.propose_for(state.token_ids, room) for state, room in zip(states, max_drafts)]

    def propose_for(self, token_ids: list[int] | np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Drafts for one request whose tokens (prompt + output) are ``token_ids``: the up to
        ``min(k, max_tokens)`` tokens that followed the latest earlier occurrence of its
        longest matching suffix. O(len(token_ids) * prompt_lookup_max)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        tokens = np.asarray(token_ids, dtype=np.int64)
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # Every earlier window of n tokens that is followed by at least one token.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return tokens[start:start + k].tolist()
        return []
