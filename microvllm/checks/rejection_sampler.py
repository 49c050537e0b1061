"""Checks for exercise 14: the rejection sampler (``residual_probs``, ``rejection_sample``).

Three kinds of check, from exact to statistical:

    residual_probs     a hand-worked 4-token example, p == q, a batch; each row sums to 1
    exact cases        greedy rows (one-hot targets, uniform 0): the argmax walk, the bonus
                       token, K = 0 rows and padding; then chosen uniforms that decide each
                       draft, so that min(1, p/q) is told apart from anything else; then the
                       token after a rejection, with and without draft_probs (argmax sampling
                       shows which distribution it came from)
    batched            the number of torch operations may not grow with B or K (no Python
                       loop over rows or drafts)
    distribution       40,000 rows drawn from fixed seeds: the first, second and bonus tokens
                       must follow the target's distributions (a chi-square test per token)

The reference is a plain Python walk over one row at a time (``reference_row``): the rule
of Leviathan et al. 2023 written as directly as possible, compared with your batched code.

The statistical cases: six chi-square tests, each at a false-alarm rate of 1 in 10,000
(a correct sampler fails one of them for under 1 seed in 1,000). The seeds are fixed, so
the verdict is the same on every run; a wrong acceptance rule or residual is off by
hundreds, far past the threshold.
"""

from __future__ import annotations

import torch

from microvllm.checks.report import Case, CheckFailure, CheckResult, expect, property_settings, run_checks, run_property

PLACEHOLDER = -1
# chi2.isf(1e-4, df): the statistic a correct sampler exceeds once in 10,000 runs.
CHI2_1_IN_10_000 = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513, 5: 25.745}
NUM_ROWS = 40_000

# The 4-token example (notebook 14 works it by hand): the drafter over-rates tokens 2 and 3.
P = torch.tensor([0.4, 0.3, 0.2, 0.1])
Q = torch.tensor([0.1, 0.2, 0.3, 0.4])
P_SECOND = torch.tensor([0.1, 0.6, 0.2, 0.1])
Q_SECOND = torch.tensor([0.25, 0.25, 0.25, 0.25])
P_BONUS = torch.tensor([0.25, 0.25, 0.1, 0.4])

HINT_RULE = ("accept draft d when uniform * q(d) < p(d), i.e. with probability min(1, p(d) / q(d)); "
             "with draft_probs None, q is one-hot at d, so q(d) = 1")
HINT_BONUS = ("when all num_draft_tokens[b] drafts are accepted, the row's next token is the bonus token, "
              "drawn from target_probs[b, num_draft_tokens[b]]")
HINT_RESIDUAL = ("at the first rejected draft, draw the replacement from residual_probs(p, q) at that "
                 "position (for draft_probs None, q is one_hot(d)), not from p itself")
HINT_FROM_P = ("the replacement after a rejection was drawn from p, not from the residual: draw it from "
               "residual_probs(p_j, q_j) at the rejected position j. The residual max(0, p - q) is 0 wherever the "
               "drafter over-rates a token (p(d) < q(d)), so a rejected draft there can never come back")
HINT_NGRAM_RESIDUAL = ("with draft_probs None (n-gram drafts), q is one-hot at the draft, so the residual "
                       "max(0, p - one_hot(d)) is p with the rejected draft removed: the replacement must never be "
                       "the draft just rejected. A q of zeros (or drawing from p) keeps it")
HINT_SHIFTED = ("draft j is checked against target_probs[b, j], the distribution computed at the position "
                "before it (p_j predicts the token after t, d1, ..., d_(j-1)): not target_probs[b, j + 1], which "
                "predicts the token after d_j")
HINT_PADDING = ("row b's drafts are draft_token_ids[b, :num_draft_tokens[b]] only: the columns after them are "
                "padding, may hold any id (even one the target likes), and are never accepted; is every "
                "acceptance limited to positions < num_draft_tokens[b]?")
HINT_GREEDY_Q = ("a greedy row keeps a draft only when it is the target's argmax (p is one-hot there); the "
                 "drafter's q enters only through uniform * q(d) < p(d), which with uniform 0 is 0 < p(d). "
                 "The argmax of q says nothing about what the target wants")


def _fmt(values) -> list[float]:
    return [round(float(v), 3) for v in values]


def reference_row(drafts: list[int], p: torch.Tensor, q: torch.Tensor | None, uniform: list[float],
                  sample_row, accept_p: torch.Tensor | None = None) -> list[int]:
    """One row, walked draft by draft: the reference ``rejection_sample`` is compared with.
    ``p``: [n + 1, V], ``q``: [n, V] or None, ``sample_row`` draws from a [V] distribution.
    ``accept_p`` (default ``p``) is what the acceptance test reads: the checks pass p shifted
    by one position to recognize that bug."""
    accept_p = p if accept_p is None else accept_p
    out = []
    for j, d in enumerate(drafts):
        q_dist = torch.nn.functional.one_hot(torch.tensor(d), p.shape[-1]).to(p.dtype) if q is None else q[j]
        if uniform[j] * q_dist[d] < accept_p[j, d]:
            out.append(d)
            continue
        residual = (p[j] - q_dist).clamp(min=0)
        out.append(sample_row(residual / residual.sum() if residual.sum() > 0 else p[j]))
        return out
    out.append(sample_row(p[len(drafts)]))
    return out


class _Sampler:
    """The ``sample`` argument: checks that every row it is given is a distribution (a row
    that does not sum to 1 is a residual someone forgot to normalize), then draws (argmax
    when ``generator`` is None, as for greedy rows)."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator
        self.calls = 0

    def __call__(self, probs: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        expect(isinstance(probs, torch.Tensor) and probs.dim() == 2,
               "sample() takes one [B, V] tensor: one distribution per row",
               got=f"{type(probs).__name__} {tuple(getattr(probs, 'shape', ()))}",
               hint="call sample(next_probs) once, with the distribution of every row's next token")
        sums = probs.sum(dim=-1)
        bad = ((sums - 1).abs() > 1e-3) | (probs < 0).any(dim=-1)
        if bool(bad.any()):
            row = int(bad.nonzero()[0])
            raise CheckFailure("sample() was given a row that is not a probability distribution",
                               input=f"row {row} of the [B, V] tensor passed to sample()",
                               expected="non-negative values summing to 1",
                               got=f"{_fmt(probs[row][:8])} (sum {float(sums[row]):.4f})",
                               hint="residual_probs must divide max(0, p - q) by its sum over the last dimension")
        if self.generator is None:
            return probs.argmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)


def _one_hot_rows(argmax: list[list[int]], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(argmax), vocab).float()


def _call(rejection_sample, drafts, num_drafts, target_probs, draft_probs, uniform, sample: _Sampler) -> torch.Tensor:
    out = rejection_sample(drafts, num_drafts, target_probs, draft_probs, uniform, sample)
    batch, k = drafts.shape
    expect(sample.calls == 1, f"rejection_sample must call sample() exactly once; it called it {sample.calls} times",
           input=f"{batch} rows, K = {k}",
           hint="build next_probs [B, V] (each row's bonus or residual distribution) and call sample(next_probs) "
                "once: the engine's sample draws every row at once, a seeded request from its own generator, "
                "so calling it per row or twice changes which numbers each request draws")
    expect(isinstance(out, torch.Tensor) and tuple(out.shape) == (batch, k + 1),
           "rejection_sample must return a [B, K + 1] tensor of token ids",
           expected=f"shape ({batch}, {k + 1})", got=f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}",
           hint="one row per request, K + 1 columns: the accepted drafts, one more token, then -1")
    expect(out.dtype == torch.long, "rejection_sample must return int64 token ids", got=str(out.dtype),
           hint="torch.full(..., PLACEHOLDER_TOKEN_ID, dtype=torch.long)")
    return out


def _greedy_hint(row_drafts: list[int], expected: list[int], got: list[int], p: torch.Tensor) -> str:
    n = len(row_drafts)
    num_kept = len([t for t in expected if t != PLACEHOLDER])
    if len([t for t in got if t != PLACEHOLDER]) > n + 1:
        return HINT_PADDING
    shifted = reference_row(row_drafts, p, None, [0.0] * n, lambda d: int(d.argmax()),
                            accept_p=torch.cat([p[1:], p[-1:]]))
    if got == shifted + [PLACEHOLDER] * (len(got) - len(shifted)):
        return HINT_SHIFTED
    if num_kept == n + 1 and got == row_drafts + [PLACEHOLDER] * (len(got) - n):
        return HINT_BONUS
    if num_kept <= n and got[:n] == row_drafts:
        return ("a greedy row's target is one-hot at its argmax and its uniform is 0: a draft is accepted only "
                "when uniform * q(d) < p(d), i.e. p(d) = 1 (the ratio is p/q, not q/p); stop at the first draft "
                "that is not the argmax")
    if n == 0:
        return "a row with no drafts still gets one token: the sample from target_probs[b, 0]"
    return ("the accepted drafts, then exactly one token (the argmax where the walk stopped), then -1 "
            "(PLACEHOLDER_TOKEN_ID); padding past num_draft_tokens[b] is never a draft")


def check_rejection_sampler(rejection_sample, residual_probs, *, max_examples: int = 40,
                            quiet: bool = False) -> CheckResult:
    """Check your ``rejection_sample`` (which calls your ``residual_probs``) and your
    ``residual_probs``; print and return the result.

    The distribution cases draw 40,000 rows from fixed seeds and run six chi-square tests,
    each with a false-alarm rate of 1 in 10,000: a correct rejection sampler passes them
    for all but under 1 seed in 1,000, and the seed here is fixed, so it always passes."""

    def residual_example():
        got = residual_probs(P.clone(), Q.clone())
        expected = torch.tensor([0.75, 0.25, 0.0, 0.0])   # max(0, p - q) = [.3, .1, 0, 0], / 0.4
        expect(isinstance(got, torch.Tensor) and got.shape == P.shape,
               "residual_probs must return a tensor shaped like p", got=f"{type(got).__name__}")
        if not torch.allclose(got, expected, atol=1e-5):
            unnormalized = torch.allclose(got, (P - Q).clamp(min=0), atol=1e-5)
            raise CheckFailure("residual_probs(p, q) must be max(0, p - q), normalized to sum to 1",
                               input=f"p = {_fmt(P)}, q = {_fmt(Q)}", expected=_fmt(expected), got=_fmt(got),
                               hint="divide by the sum over the last dimension (keepdim=True): the residual is "
                                    "a distribution to sample from" if unnormalized else
                                    "clamp p - q at 0 (tokens the drafter over-rates get nothing), then divide "
                                    "by the sum")

    def residual_p_equals_q():
        got = residual_probs(P.clone(), P.clone())
        expect(bool(torch.isfinite(got).all()) and torch.allclose(got, P, atol=1e-6),
               "residual_probs(p, p) must be p: nothing is left over, and 0 / 0 must not become NaN",
               input=f"p = q = {_fmt(P)}", expected=_fmt(P), got=_fmt(got),
               hint="where the sum of max(0, p - q) is 0, return p (torch.where(total > 0, residual / total, p)); "
                    "such a draft is never rejected, but the value must stay a distribution")

    def residual_batched():
        gen = torch.Generator().manual_seed(5)
        p = torch.rand(3, 4, 50, generator=gen).softmax(-1)
        q = torch.rand(3, 4, 50, generator=gen).mul(3).softmax(-1)
        q[1, 2] = p[1, 2]
        before = p.clone(), q.clone()
        got = residual_probs(p, q)
        expect(torch.equal(p, before[0]) and torch.equal(q, before[1]),
               "residual_probs must not modify p or q (the caller uses them again)",
               hint="p - q makes a new tensor: clamp that one, not p")
        sums = got.sum(-1)
        expect(bool(torch.allclose(sums, torch.ones_like(sums), atol=1e-5)),
               "every row of residual_probs must sum to 1 over the last dimension",
               input="p, q of shape [3, 4, 50] (one row with p == q)", got=f"row sums {_fmt(sums.flatten()[:6])} ...",
               hint="sum over dim=-1 with keepdim=True, so that the division broadcasts per row")
        residual = (p - q).clamp(min=0)
        expected = residual / residual.sum(-1, keepdim=True)
        expected[1, 2] = p[1, 2]
        expect(bool(torch.allclose(got, expected, atol=1e-5)), "residual_probs is wrong on a batch of rows",
               input="p, q of shape [3, 4, 50]", hint="everything along the last dimension, every row on its own")

    def greedy_walk():
        vocab = 10
        #            drafts            num  target's argmax at positions 0..3
        rows = [([5, 2, 7], 3, [5, 2, 7, 1]),     # all accepted: then the bonus token 1
                ([5, 2, 7], 3, [5, 3, 8, 8]),     # the second is not the argmax: [5, 3]
                ([4, 4, 4], 3, [6, 4, 4, 4]),     # the first is rejected: [6]
                ([-1, -1, -1], 0, [9, 0, 0, 0]),  # no drafts: one ordinary token
                ([1, 1, -1], 2, [1, 1, 9, 3]),    # 2 drafts, both right: the bonus is position 2's
                ([3, 7, 7], 1, [3, 7, 7, 2])]     # 1 draft; the padding (7, 7) is what the target
                #                                   would say, yet it is not a draft: [3, 7]
        drafts = torch.tensor([r[0] for r in rows])
        num = torch.tensor([r[1] for r in rows])
        target = _one_hot_rows([r[2] for r in rows], vocab)
        got = _call(rejection_sample, drafts, num, target, None, torch.zeros(len(rows), 3), _Sampler())
        for b, (row_drafts, n, argmax) in enumerate(rows):
            expected = reference_row(row_drafts[:n], target[b], None, [0.0] * n, lambda d: int(d.argmax()))
            expected += [PLACEHOLDER] * (4 - len(expected))
            if got[b].tolist() != expected:
                raise CheckFailure(f"greedy row {b}: drafts {row_drafts[:n]}, the target's argmax at each position "
                                   f"{argmax[:n + 1]}", input="one-hot target_probs, uniform 0, draft_probs None "
                                   f"({len(rows)} rows, K = 3)", expected=expected, got=got[b].tolist(),
                                   hint=_greedy_hint(row_drafts[:n], expected, got[b].tolist(), target[b]))

    def greedy_with_draft_probs():
        # Greedy rows with a drafter that samples: q(d) < 1, still accepted exactly at the argmax.
        # Row 1's draft is the drafter's favourite (argmax of q) but not the target's.
        target = _one_hot_rows([[3, 0, 2], [1, 0, 0]], 4)
        draft_probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]],
                                    [[0.1, 0.1, 0.7, 0.1], [0.25, 0.25, 0.25, 0.25]]])
        got = _call(rejection_sample, torch.tensor([[3, 1], [2, 0]]), torch.tensor([2, 2]), target, draft_probs,
                    torch.zeros(2, 2), _Sampler())
        expect(got[0].tolist() == [3, 0, -1], "greedy row 0 with draft_probs: drafts [3, 1], argmax [3, 0, 2]",
               input="q(3) = 0.4 at position 0, q(1) = 0.1 at position 1; uniform 0",
               expected=[3, 0, -1], got=got[0].tolist(),
               hint="the residual of a one-hot p at its argmax a is one-hot at a (p - q is positive only there): "
                    "the replacement is the argmax. " + HINT_RULE)
        expect(got[1].tolist() == [1, -1, -1], "greedy row 1 with draft_probs: draft 2 is the drafter's argmax "
               "(q = [0.1, 0.1, 0.7, 0.1]) but the target's argmax is 1",
               input="uniform 0, p one-hot at 1", expected=[1, -1, -1], got=got[1].tolist(),
               hint=HINT_GREEDY_Q if got[1, 0] == 2 else HINT_RULE)

    def chosen_uniforms():
        # One draft per row; the uniform decides: accepted iff uniform * q(d) < p(d).
        #          p(d)  q(d)  uniform  accepted?   why
        cases = [(0.2, 0.8, 0.5, False),  # p/q = 0.25 < 0.5
                 (0.2, 0.8, 0.2, True),   # 0.2 * 0.8 = 0.16 < 0.2
                 (0.6, 0.3, 0.99, True),  # p > q: always accepted
                 (0.3, 0.6, 0.45, True),  # 0.27 < 0.3
                 (0.3, 0.6, 0.55, False)]  # 0.33 >= 0.3
        vocab = 4
        target = torch.zeros(len(cases), 2, vocab)
        draft_probs = torch.zeros(len(cases), 1, vocab)
        for b, (p_d, q_d, _, _) in enumerate(cases):
            target[b, 0] = torch.tensor([p_d, (1 - p_d) / 3, (1 - p_d) / 3, (1 - p_d) / 3])
            draft_probs[b, 0] = torch.tensor([q_d, (1 - q_d) / 3, (1 - q_d) / 3, (1 - q_d) / 3])
            target[b, 1] = torch.tensor([0.1, 0.2, 0.3, 0.4])
        uniform = torch.tensor([[u] for _, _, u, _ in cases])
        got = _call(rejection_sample, torch.zeros(len(cases), 1, dtype=torch.long), torch.ones(len(cases),
                    dtype=torch.long), target, draft_probs, uniform, _Sampler())
        for b, (p_d, q_d, u, accept) in enumerate(cases):
            kept = int(got[b, 0]) == 0
            if kept and not accept and got[b].tolist() == [0, PLACEHOLDER]:
                raise CheckFailure(
                    f"draft 0 with p(d) = {p_d}, q(d) = {q_d} and uniform {u} was rejected (one token, no bonus), "
                    "but the token that replaced it is the rejected draft itself",
                    input=f"row {b} of 5, one draft each, draft_probs given; sample = argmax",
                    expected=f"a token other than 0: the residual max(0, p - q) is 0 at token 0 ({p_d} < {q_d})",
                    got=got[b].tolist(), hint=HINT_FROM_P)
            if kept != accept:
                raise CheckFailure(
                    f"draft 0 with p(d) = {p_d}, q(d) = {q_d} and uniform {u} must be "
                    + ("accepted" if accept else "rejected")
                    + f": min(1, p/q) = {min(1.0, p_d / q_d):.3g}, and it is accepted when uniform * q(d) < p(d)",
                    input=f"row {b} of 5, one draft each, draft_probs given", got=got[b].tolist(),
                    hint=HINT_RULE + (" (p/q, not q/p)" if not accept and p_d < q_d else ""))
            expect(bool(got[b, 1] != PLACEHOLDER) if accept else bool(got[b, 1] == PLACEHOLDER),
                   f"row {b}: " + ("the draft was accepted, so the bonus token must follow it" if accept else
                                   "the draft was rejected: one replacement token, then -1"),
                   got=got[b].tolist(), hint=HINT_BONUS if accept else HINT_RESIDUAL)

    def after_a_rejection(with_q: bool):
        # Each row rejects its one draft; sample = argmax shows which distribution was drawn from.
        # Row 0: p = [0.35, 0.3, 0.25, 0.1], draft 0. With q = [0.6, 0.1, 0.1, 0.2] the residual is
        # max(0, p - q) = [0, 0.2, 0.15, 0] -> argmax 1, while p's argmax is the rejected draft 0.
        # Token-only (q one-hot at 0): the residual is p without token 0 -> argmax 1, again not 0.
        p = torch.tensor([[0.35, 0.3, 0.25, 0.1], [0.25, 0.25, 0.25, 0.25]])
        q = torch.tensor([[[0.6, 0.1, 0.1, 0.2]]]) if with_q else None
        uniform = torch.tensor([[0.99]])          # 0.99 * q(0) > p(0): rejected
        got = _call(rejection_sample, torch.tensor([[0]]), torch.tensor([1]), p.unsqueeze(0), q, uniform,
                    _Sampler())
        if got[0].tolist() == [1, PLACEHOLDER]:
            return
        came_back = int(got[0, 0]) == 0 and int(got[0, 1]) == PLACEHOLDER
        raise CheckFailure(
            "the token after a rejected draft must come from the residual",
            input=("p = [0.35, 0.3, 0.25, 0.1], draft 0 with " + ("q = [0.6, 0.1, 0.1, 0.2]" if with_q else
                   "draft_probs None (q one-hot at 0)") + ", uniform 0.99 (rejected); sample = argmax"),
            expected="[1, -1]: 1 is the residual's argmax (" + ("max(0, p - q))" if with_q else "p without the draft)"),
            got=got[0].tolist(),
            hint=(HINT_FROM_P if with_q else HINT_NGRAM_RESIDUAL) if came_back else
            HINT_RULE + "; on a rejection, " + HINT_RESIDUAL)

    def batched():
        from torch.overrides import TorchFunctionMode

        class CountOps(TorchFunctionMode):
            def __init__(self):
                super().__init__()
                self.count = 0

            def __torch_function__(self, func, types, args=(), kwargs=None):
                self.count += 1
                return func(*args, **(kwargs or {}))

        def ops(batch: int, k: int) -> int:
            gen = torch.Generator().manual_seed(batch * 10 + k)
            target = torch.rand(batch, k + 1, 6, generator=gen).softmax(-1)
            q = torch.rand(batch, k, 6, generator=gen).softmax(-1)
            drafts = torch.randint(0, 6, (batch, k), generator=gen)
            num = torch.full((batch,), k)
            uniform = torch.rand(batch, k, generator=gen)
            with CountOps() as counter:
                rejection_sample(drafts, num, target, q, uniform, _Sampler())
            return counter.count

        small, many_rows, many_drafts = ops(4, 3), ops(64, 3), ops(4, 12)
        for what, count, bigger in (("rows", many_rows, "64 rows instead of 4"),
                                    ("drafts", many_drafts, "K = 12 instead of 3")):
            expect(count <= small + 8, f"rejection_sample runs a Python loop over {what}: {bigger} took {count} "
                   f"torch operations against {small}",
                   input="B = 4, K = 3 against " + bigger + " (draft_probs given)",
                   expected="the same number of tensor operations whatever B and K",
                   hint="the contract asks for whole-batch tensor operations: which values does every row need "
                        "(p(d), q(d), how many drafts it keeps, its next distribution), and can each be one "
                        "tensor with a row per request, built by indexing the batch at once?")

    def against_the_walk():
        from hypothesis import given, strategies as st

        @property_settings(max_examples, report_multiple_bugs=False)
        @given(st.integers(1, 5), st.integers(0, 4), st.integers(2, 6), st.booleans(), st.booleans(),
               st.integers(0, 2**31 - 1))
        def random_batches(batch, k, vocab, with_q, greedy, seed):
            gen = torch.Generator().manual_seed(seed)
            num = torch.randint(0, k + 1, (batch,), generator=gen)
            target = torch.rand(batch, k + 1, vocab, generator=gen).mul(4).softmax(-1)
            if greedy:
                target = torch.nn.functional.one_hot(target.argmax(-1), vocab).float()
            q = torch.rand(batch, k, vocab, generator=gen).mul(4).softmax(-1) if with_q else None
            drafts = torch.randint(0, vocab, (batch, k), generator=gen)
            drafts = torch.where(torch.arange(k) < num.unsqueeze(1), drafts, PLACEHOLDER)
            uniform = torch.zeros(batch, k) if greedy else torch.rand(batch, k, generator=gen)
            got = _call(rejection_sample, drafts, num, target, q, uniform, _Sampler())
            for b in range(batch):
                n = int(num[b])
                expected = reference_row(drafts[b, :n].tolist(), target[b], None if q is None else q[b],
                                         uniform[b].tolist(), lambda d: int(d.argmax()))
                expected += [PLACEHOLDER] * (k + 1 - len(expected))
                if got[b].tolist() != expected:
                    raise CheckFailure(
                        f"row {b} differs from the draft-by-draft walk",
                        input=f"B={batch}, K={k}, V={vocab}, num_draft_tokens={num.tolist()}, "
                              f"draft_probs {'given' if with_q else 'None'}, {'greedy' if greedy else 'random'} "
                              f"rows, drafts {drafts[b, :n].tolist()}, uniform {_fmt(uniform[b, :n])}, "
                              "sample = argmax",
                        expected=expected, got=got[b].tolist(),
                        hint=HINT_BONUS if got[b].tolist()[:n] == expected[:n] and len(expected) > n
                        and got[b, n] == PLACEHOLDER and expected[n] != PLACEHOLDER else HINT_RULE)

        run_property(random_batches)

    def distribution(with_q: bool):
        gen = torch.Generator().manual_seed(2023 if with_q else 2024)
        vocab, k = 4, 2
        target = torch.stack([P, P_SECOND, P_BONUS]).expand(NUM_ROWS, -1, -1).contiguous()
        if with_q:
            draft_probs = torch.stack([Q, Q_SECOND]).expand(NUM_ROWS, -1, -1).contiguous()
            # The theorem's premise: each draft is drawn from the distribution it is checked with.
            drafts = torch.stack([torch.multinomial(Q, NUM_ROWS, replacement=True, generator=gen),
                                  torch.multinomial(Q_SECOND, NUM_ROWS, replacement=True, generator=gen)], 1)
        else:   # token-only drafts: any fixed guesses (here every pair of tokens in turn)
            draft_probs = None
            rows = torch.arange(NUM_ROWS)
            drafts = torch.stack([rows % vocab, (rows // vocab) % vocab], 1)
        uniform = torch.rand(NUM_ROWS, k, generator=gen)
        got = _call(rejection_sample, drafts, torch.full((NUM_ROWS,), k), target, draft_probs, uniform,
                    _Sampler(gen))
        where = (f"{NUM_ROWS:,} rows, K = 2, " + ("drafts drawn from q1 = " + str(_fmt(Q)) + ", q2 = "
                 + str(_fmt(Q_SECOND)) if with_q else "draft_probs None, drafts every pair of tokens")
                 + f"; p1 = {_fmt(P)}, p2 = {_fmt(P_SECOND)}, p3 = {_fmt(P_BONUS)}")
        first_kept = got[:, 0] == drafts[:, 0]
        both_kept = first_kept & (got[:, 1] == drafts[:, 1])
        _chi_square(got[:, 0], P, "token 1", where, HINT_RULE + "; on a rejection, " + HINT_RESIDUAL)
        _chi_square(got[first_kept, 1], P_SECOND, "token 2 (draft 1 kept)", where,
                    HINT_RULE + "; on a rejection, " + HINT_RESIDUAL)
        bonus = got[both_kept, 2]
        expect(bool((bonus != PLACEHOLDER).all()),
               f"{int((bonus == PLACEHOLDER).sum()):,} of {len(bonus):,} rows accepted both drafts but got no bonus "
               "token", input=where, hint=HINT_BONUS)
        _chi_square(bonus, P_BONUS, "the bonus (both drafts kept)", where, HINT_BONUS)

    cases = [
        Case("residual_probs on the 4-token example: max(0, p - q), normalized", residual_example),
        Case("residual_probs(p, p) is p (nothing left, and no NaN)", residual_p_equals_q),
        Case("residual_probs on a batch: every row sums to 1, inputs untouched", residual_batched),
        Case("greedy rows: the argmax walk, the bonus token, K = 0 rows and padding", greedy_walk),
        Case("a greedy row with draft_probs given is still the argmax walk", greedy_with_draft_probs),
        Case("chosen uniforms: a draft is accepted exactly when uniform * q(d) < p(d)", chosen_uniforms),
        Case("the token after a rejection, draft_probs given: from max(0, p - q), normalized",
             lambda: after_a_rejection(True)),
        Case("the token after a rejection, token-only drafts: from p without the rejected draft",
             lambda: after_a_rejection(False)),
        Case("batched: no Python loop over rows or drafts (operations counted at two sizes)", batched),
        Case(f"property: {max_examples} random batches against a draft-by-draft walk", against_the_walk),
        Case("distribution, draft_probs given: first, second and bonus tokens follow the target "
             "(chi-square, false alarm 1 in 10,000 each)", lambda: distribution(True)),
        Case("distribution, token-only drafts (draft_probs None): the same three tests", lambda: distribution(False)),
    ]
    return run_checks("rejection_sample", cases, quiet=quiet)


def _chi_square(tokens: torch.Tensor, expected_probs: torch.Tensor, what: str, where: str, hint: str) -> None:
    """Fail unless ``tokens`` look drawn from ``expected_probs`` (chi-square, false alarm 1e-4)."""
    vocab = len(expected_probs)
    stray = tokens[(tokens < 0) | (tokens >= vocab)]
    expect(len(stray) == 0, f"{what}: {len(stray):,} rows hold {int(stray[0]) if len(stray) else ''}, not a token",
           input=where, hint=HINT_BONUS if len(stray) and int(stray[0]) == PLACEHOLDER else
           "every output token is a vocabulary id or, after the row's last token, -1")
    n = len(tokens)
    counts = torch.bincount(tokens, minlength=vocab).double()
    expected = expected_probs.double() * n
    statistic = float(((counts - expected) ** 2 / expected).sum())
    threshold = CHI2_1_IN_10_000[vocab - 1]
    if statistic > threshold:
        raise CheckFailure(
            f"{what} is off the target's p: chi-square {statistic:,.1f} > {threshold:.1f}",
            input=where, expected=f"frequencies {_fmt(expected_probs)} (chi-square at most {threshold}: a correct "
                                  f"sampler exceeds it once in 10,000 runs, {vocab - 1} degrees of freedom)",
            got=f"frequencies {_fmt(counts / n)}", hint=hint)
