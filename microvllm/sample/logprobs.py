"""Log-probabilities returned with each sampled token (``SamplingParams.logprobs``).

Like vLLM V1 by default, they are the log-softmax of the *raw* logits: before
temperature, top-k/top-p/min-p or min_tokens. They describe what the model
predicted, not the filtered distribution the token was drawn from.

For N requested logprobs each row gets N + 1 columns, the sampled token first::

    logprob_token_ids  [num_reqs, N+1]   [ sampled | top-1  top-2 ... top-N ]
    logprobs           [num_reqs, N+1]   their log-probabilities
    selected_token_ranks [num_reqs]      1 = the sampled token was the most likely

A batch is gathered once with the largest N any of its requests asked for; the
engine keeps the first ``params.logprobs`` top columns of each request's row.

Prompt logprobs (``SamplingParams.prompt_logprobs``) come from the same hidden
states, one row per prompt position whose *next* token is also in the prompt::

    prompt           t0    t1    t2    t3          (4 tokens)
    logits at        p0    p1    p2    p3
    predicts         t1    t2    t3    (first output token: that is the sample)
    prompt_logprobs  None  {t1}  {t2}  {t3}        t0 has none: nothing predicts it

With chunked prefill a prompt arrives in pieces, so each chunk yields the rows of
its own positions, with ``start`` saying which prompt token the first row is for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from microvllm.core.outputs import LogprobsLists  # what the engine core hands on: plain lists


@dataclass(frozen=True)
class LogprobsTensors:
    logprob_token_ids: torch.Tensor     # [num_reqs, N+1] int64
    logprobs: torch.Tensor              # [num_reqs, N+1] float32
    selected_token_ranks: torch.Tensor  # [num_reqs] int64

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """The same three tensors as Python lists (what the engine puts in outputs)."""
        return (self.logprob_token_ids.tolist(), self.logprobs.tolist(),
                self.selected_token_ranks.tolist())


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log p(token) for every token of every row: ``log_softmax`` over the vocabulary."""
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                    token_ids: torch.Tensor) -> LogprobsTensors:
    """The sampled token's logprob and rank, plus the top ``num_logprobs`` of each row."""
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    token_ids = token_ids.unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    # Rank as vLLM counts it: how many tokens are at least as likely as the sampled one.
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    return LogprobsTensors(
        logprob_token_ids=torch.cat([token_ids, top_ids], dim=-1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=-1),
        selected_token_ranks=ranks,
    )


def prompt_logprobs_of_chunk(compute_logits, hidden: torch.Tensor, token_ids: list[int],
                             num_prompt_tokens: int, start: int, num_tokens: int,
                             num_logprobs: int) -> LogprobsLists | None:
    """Prompt logprobs of the chunk ``positions [start, start + num_tokens)`` of one request.

    ``hidden``: the chunk's hidden states, one row per position; ``compute_logits``:
    the model's head. Position p's logits score prompt token p + 1, so only positions
    before the last prompt token count (the last one predicts the first output).
    None when the chunk has no such position (a decode, or the prompt's last token).
    """
    end = min(start + num_tokens, num_prompt_tokens - 1)
    if end <= start:
        return None
    logprobs = compute_logprobs(compute_logits(hidden[:end - start]).float())
    targets = torch.tensor(token_ids[start + 1:end + 1], dtype=torch.long, device=logprobs.device)
    ids, values, ranks = gather_logprobs(logprobs, num_logprobs, targets).tolists()
    return LogprobsLists(ids, values, ranks, start=start + 1)
