"""Exercise 14's checker: for each bug a learner is likely to write, the first failure's hint
names that bug, not a neighbouring rule (issue 40, item 6).

Each mutant is a copy of the package's ``rejection_sampler`` module with one line changed.
"""

import re

import pytest

from microvllm import checks
from microvllm.sample import rejection_sampler as rejection_module
from microvllm.sample.rejection_sampler import rejection_sample, residual_probs
from tests.course.mutants import mutant

ACCEPT = "accepted = (uniform * q_of_draft < p_of_draft) & is_draft"

BUGS = {
    # The token after a rejection drawn from p, as if no draft had been proposed.
    "replacement from p, not the residual": (
        [("next_probs = torch.where(all_accepted, p_next, residual_probs(p_next, q_next))", "next_probs = p_next")],
        r"hint: +the replacement after a rejection was drawn from p, not from the residual"),
    # Token-only drafts: q taken as zeros instead of one_hot(d), so the residual is p and keeps d.
    "n-gram residual keeps the rejected draft": (
        [("torch.nn.functional.one_hot(drafts[rows, at], p_next.shape[-1]).to(p_next.dtype)",
          "torch.zeros_like(p_next)")],
        r"token-only drafts.*hint: +with draft_probs None.*p with the rejected draft removed"),
    # Greedy rows special-cased: keep a draft when it is the drafter's favourite.
    "greedy accepts the argmax of q": (
        [(ACCEPT, "greedy_pick = (target_probs[:, :max_drafts] if draft_probs is None else draft_probs).argmax(-1)\n"
                  "    accepted = torch.where(uniform == 0, drafts == greedy_pick, "
                  "uniform * q_of_draft < p_of_draft) & is_draft")],
        r"greedy row 1 with draft_probs.*hint: +a greedy row keeps a draft only when it is the target's argmax"),
    # Draft j checked against the distribution one position later.
    "position i+1's probabilities": (
        [("p_of_draft = target_probs[:, :max_drafts].gather(",
          "p_of_draft = target_probs[:, 1:max_drafts + 1].gather(")],
        r"greedy row 0.*hint: +draft j is checked against target_probs\[b, j\].*not target_probs\[b, j \+ 1\]"),
    # num_draft_tokens ignored: the padding columns are checked like drafts.
    "padding counted as drafts": (
        [("drafts = torch.where(is_draft, draft_token_ids, 0)", "drafts = draft_token_ids.clamp(min=0)"),
         (ACCEPT, "accepted = uniform * q_of_draft < p_of_draft")],
        r"greedy row 5.*hint: +row b's drafts are draft_token_ids\[b, :num_draft_tokens\[b\]\] only.*padding"),
}


@pytest.mark.parametrize("name", BUGS)
def test_first_hint_names_the_real_bug(name):
    replacements, pattern = BUGS[name]
    copy = mutant(rejection_module, replacements)
    result = checks.check_rejection_sampler(copy.rejection_sample, copy.residual_probs, max_examples=10, quiet=True)
    assert not result.passed and not result.not_implemented, result.report()
    first = next(case for case in result.cases if case.status == "fail")
    explained = "\n".join(first.lines)
    assert re.search(pattern, first.name + "\n" + explained, re.S), (name, result.report())


@pytest.mark.slow   # 11-14 s on 2 cores: the row-by-row sampler runs every statistical case a row at a time
def test_a_loop_over_rows_is_refused():
    def one_row_at_a_time(drafts, num, target, q, uniform, sample):
        rows = [rejection_sample(drafts[b:b + 1], num[b:b + 1], target[b:b + 1], None if q is None else q[b:b + 1],
                                 uniform[b:b + 1], lambda probs: probs.argmax(-1)) for b in range(len(drafts))]
        sample(target[:, 0])   # once, as the contract asks: the loop alone must be what fails
        import torch
        return torch.cat(rows)

    result = checks.check_rejection_sampler(one_row_at_a_time, residual_probs, max_examples=10, quiet=True)
    first = next(case for case in result.cases if case.status == "fail")
    assert first.name.startswith("batched"), result.report()
    assert re.search(r"Python loop over rows", "\n".join(first.lines)), result.report()


def test_chi_square_summaries_are_not_cut_off():
    # A second failing case is summarized in one line of at most 80 characters: the chi-square
    # figure must fit in it whole.
    wrong_bonus = mutant(rejection_module, [("p_next = target_probs[rows, num_accepted]",
                                             "p_next = target_probs[rows, num_accepted.clamp(max=0)]")])
    result = checks.check_rejection_sampler(wrong_bonus.rejection_sample, residual_probs, max_examples=10, quiet=True)
    chi = [case.lines[0] for case in result.cases if case.status == "fail" and "chi-square" in case.lines[0]]
    assert chi and all(len(line) <= 80 for line in chi), result.report()
    assert "…" not in result.report(), result.report()
