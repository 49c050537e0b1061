"""Per-request rules that change the logits before sampling (vLLM: ``v1/sample/
logits_processor/builtin.py``, ``v1/sample/ops/bad_words.py``).

Each is a sparse, per-row rule, so each is one indexed write for the whole batch::

    logit_bias          {row: {id: bias}}   logits[row, id] += bias          (OpenAI's)
    allowed_token_ids   {row: [ids]}        every other id of the row -> -inf
    bad words           {row: {ids}}        those ids -> -inf this step (see below;
                                            banned with penalties.apply_min_tokens_penalty)

A bad word is a token sequence (the engine tokenizes each word at the door, with and
without a leading space). Its last token is banned only where the output already
ends with the rest of it::

    bad word " New York" -> [7, 9]        output so far [..., 3, 7]   -> ban 9 now
                                          output so far [..., 3, 4]   -> nothing banned
    a one-token bad word [5]              -> ban 5 at every step
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def apply_logit_bias(logits: torch.Tensor, biases: dict[int, dict[int, float]]) -> None:
    """``logits[row, id] += bias`` in place for every row's ``{id: bias}``."""
    rows, ids, values = [], [], []
    for row, bias in biases.items():
        for token_id, value in bias.items():
            rows.append(row)
            ids.append(token_id)
            values.append(value)
    if rows:
        logits[rows, ids] += torch.tensor(values, dtype=logits.dtype, device=logits.device)


def apply_allowed_token_ids(logits: torch.Tensor, allowed: dict[int, list[int]]) -> None:
    """Set every logit of a listed row to -inf except its allowed ids, in place."""
    if not allowed:
        return
    keep = torch.zeros(len(allowed), logits.shape[-1], dtype=torch.bool, device=logits.device)
    for index, ids in enumerate(allowed.values()):
        keep[index, list(ids)] = True
    rows = list(allowed)
    logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))


def bad_words_banned_ids(bad_words_token_ids: Sequence[Sequence[int]],
                         output_token_ids: Sequence[int]) -> set[int]:
    """The ids one request must not sample next: the last token of each bad word whose
    other tokens end the output so far."""
    banned = set()
    for word in bad_words_token_ids:
        prefix = list(word[:-1])
        if not prefix or list(output_token_ids[len(output_token_ids) - len(prefix):]) == prefix:
            banned.add(word[-1])
    return banned
