"""Compare speculative decoding step by step: which drafts each step kept, yours against the
reference's (exercise 14's engine cell).

    first_spec_difference(reference, yours, spec)  -> None, or (lines, hint)

At every step a request with drafts sends ``1 + d`` tokens through the target (its last
token and d drafts); the rejection sampler answers with the drafts it keeps and one more
token. The traces record, per step, how many tokens each request scheduled and which
tokens it got::

    step 5   request 1: 1 + 3 drafts [29, 487, 307]     reference got [29, 487, 118]
                                                        yours got     [29, 487, 307, 12]

Until the first step where the tokens differ, both runs hold the same text, so the n-gram
drafter proposed the same drafts to both: that step shows the first decision of your
rejection sampler that differs from the reference's, with its drafts rebuilt from the
text so far.
"""

from __future__ import annotations

HINT_ACCEPT_MORE = ("your sampler kept a draft the reference rejects: accept draft d only when uniform * q(d) < "
                    "p(d) (n-gram drafts give no draft_probs: q(d) = 1, so uniform < p(d)), and stop at the "
                    "first rejection")
HINT_ACCEPT_FEWER = ("your sampler rejected a draft the reference keeps: accept when uniform * q(d) < p(d), "
                     "i.e. with probability min(1, p(d) / q(d)), p/q and not q/p")
HINT_BONUS = ("every draft was kept, so one bonus token must follow, drawn from target_probs[b, "
              "num_draft_tokens[b]]")
HINT_NEXT = ("the same drafts kept, another next token: call sample() once, with every row's next-token "
             "distribution (the residual max(0, p - q), normalized, at the first rejection; the bonus "
             "position's p when all were kept), so that a seeded request draws what the reference draws")
# (regex of the engine's error, hint) when a rejection sampler makes the engine stop.
SPEC_HINTS = [
    (r"no sampled token for request", "every row needs one token after its accepted drafts: the replacement at "
                                      "the first rejection, or the bonus token when all were kept (a row with no "
                                      "drafts too: its bonus position is 0)"),
]
HINT_DRAFT_AGAIN = ("where the reference rejected a draft, your token is that draft itself: either you kept it "
                    "(then one more token must follow it), or you drew it as the replacement: the residual "
                    "max(0, p - q) is 0 at the rejected draft (n-gram drafts: q is one-hot at d, so the residual "
                    "is p with d removed, renormalized)")
HINT_GREEDY = ("a greedy request's target is one-hot at its argmax and its uniform is 0: keep drafts while "
               "they are the argmax, then the argmax")


def _history(trace, until: int) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for step in list(trace)[:until]:
        for rid, new in step.new_tokens.items():
            tokens.setdefault(rid, []).extend(new)
    return tokens


def first_spec_difference(reference, yours, spec: dict, prompt_token_ids: dict[str, list[int]],
                          greedy: set[str]):
    """The first step where your run's new tokens differ from the reference's, in words."""
    from microvllm.spec_decode.ngram_proposer import NgramProposer

    ref_steps, your_steps = list(reference.trace), list(yours.trace)
    for index, (ref, mine) in enumerate(zip(ref_steps, your_steps)):
        if ref.new_tokens == mine.new_tokens:
            continue
        scheduled = {r.request_id: r for r in ref.scheduled}
        rid = next(r for r in sorted(set(ref.new_tokens) | set(mine.new_tokens), key=_key)
                   if ref.new_tokens.get(r) != mine.new_tokens.get(r))
        want, got = ref.new_tokens.get(rid, []), mine.new_tokens.get(rid, [])
        request = scheduled.get(rid)
        num_drafts = 0
        if request is not None and request.num_computed_tokens_before >= request.num_prompt_tokens:
            num_drafts = request.num_scheduled_tokens - 1
        so_far = prompt_token_ids.get(rid, []) + _history(reference.trace, index).get(rid, [])
        proposer = NgramProposer(spec.get("prompt_lookup_min", 1), spec.get("prompt_lookup_max", 1),
                                 spec["num_speculative_tokens"])
        drafts = proposer.propose_for(so_far)[:num_drafts] if num_drafts else []
        kind = "greedy" if rid in greedy else "seeded"
        lines = [f"step {index}: request {rid} ({kind}) checked {num_drafts} draft{'s' if num_drafts != 1 else ''}"
                 + (f" {drafts}" if drafts else "") + ", and got other tokens than the reference",
                 f"  reference: {_kept(want, drafts)}", f"  yours:     {_kept(got, drafts)}"]
        ref_kept, your_kept = _num_kept(want, drafts), _num_kept(got, drafts)
        last = len(want) - 1
        if len(got) == len(want) and got[:last] == want[:last] and last < len(drafts) and got[last] == drafts[last]:
            hint = HINT_DRAFT_AGAIN
        elif len(got) == len(want) and got[:last] == want[:last]:
            hint = HINT_GREEDY if rid in greedy else HINT_NEXT
        elif your_kept > ref_kept:
            hint = HINT_ACCEPT_MORE
        elif your_kept < ref_kept:
            hint = HINT_ACCEPT_FEWER
        elif your_kept == len(drafts) and len(got) == len(drafts):
            hint = HINT_BONUS
        else:
            hint = HINT_GREEDY if rid in greedy else HINT_NEXT
        return lines, hint
    if len(ref_steps) != len(your_steps):
        return [f"your run took {len(your_steps)} steps, the reference {len(ref_steps)}, with the same tokens "
                "at every step they share"], HINT_BONUS
    return None


def _num_kept(tokens: list[int], drafts: list[int]) -> int:
    kept = 0
    while kept < min(len(tokens), len(drafts)) and tokens[kept] == drafts[kept]:
        kept += 1
    return kept


def _kept(tokens: list[int], drafts: list[int]) -> str:
    if not drafts:
        return f"{tokens} (no drafts: one ordinary token)"
    kept = _num_kept(tokens, drafts)
    rest = tokens[kept:]
    after = ("nothing after them" if not rest else
             f"then {rest[0]}" + (" (bonus)" if kept == len(drafts) else "") + (f", then {rest[1:]}" if rest[1:]
                                                                                 else ""))
    return f"{tokens}: kept {kept} of the drafts, {after}"


def _key(request_id: str):
    return (0, int(request_id), "") if request_id.isdigit() else (1, 0, request_id)
