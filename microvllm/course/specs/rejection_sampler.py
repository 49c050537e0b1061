"""Exercise 14: the rejection sampler of speculative decoding."""

from microvllm.course.exercise import Exercise, Part
from microvllm.sample.rejection_sampler import RejectionSampler, rejection_sample, residual_probs

EXERCISE = Exercise(
    number="14", slug="rejection_sampler", title="Speculative decoding: the rejection sampler",
    lecture="14 · speculative decoding",
    intro="""You write the rule that makes speculative decoding exact: the target model has scored a
request's last token and its k draft tokens in one forward, and the rejection sampler decides which
drafts to keep and which one token to add. Keep draft d with probability min(1, p(d) / q(d)); at the
first rejection draw from the residual max(0, p − q), normalized; when every draft is kept, add a
bonus token from the target's next distribution. Each output token is then distributed exactly as
if the target had sampled it alone (Leviathan et al. 2023, Chen et al. 2023).""",
    setup="""
from collections.abc import Callable

import torch
from torch import nn

from microvllm.sample.metadata import SamplingMetadata
from microvllm.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, SpecDecodeMetadata
from microvllm.sample.topk_topp_sampler import apply_min_p, apply_top_k, apply_top_p, random_sample
from microvllm.sampling_params import SAMPLING_EPS
from microvllm.checks import check_rejection_sampler, run_engine_with
""",
    parts=(Part(residual_probs, intro="""What a rejected position's token is drawn from. Worked by hand on
4 tokens: p = [0.4, 0.3, 0.2, 0.1] (target), q = [0.1, 0.2, 0.3, 0.4] (drafter); p − q = [0.3, 0.1,
−0.1, −0.3]; clamped [0.3, 0.1, 0, 0]; normalized [0.75, 0.25, 0, 0]. The tokens the drafter
over-rates get nothing: they were already proposed too often."""),
           Part(rejection_sample, intro="""One forward of the target over a request's last token t and its
drafts gives the target's distribution at every draft, and one more:

    input to the target    t     d1    d2    d3          (k = 3 drafts)
    target's distribution  p1    p2    p3    p4          p_j predicts the token after
    compared with          d1    d2    d3    (bonus)

Walk left to right: keep d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection
draw one token from the residual and stop; if all are kept, draw the bonus from p4. In the batch,
row b has `num_draft_tokens[b]` drafts (0 to K) and its bonus position is `num_draft_tokens[b]`."""),
           Part(RejectionSampler, intro="""The engine's module around your function: it turns the target's
logits at every draft position into distributions (temperature, top-k, top-p, min-p; one-hot at the
argmax for greedy requests), draws the uniforms (a seeded request from its own generator), scatters
them into the padded `[B, K + 1, V]` layout, and calls *your* `rejection_sample` above.""")),
    todos={
        "residual_probs": "clamp p - q at 0 and divide by its sum over the last dimension; "
                          "where that sum is 0 (p == q), return p",
        "rejection_sample": "accept draft j while uniform * q(d) < p(d) (q(d) = 1 without draft_probs); "
                            "then one token from the residual at the first rejection, or the bonus "
                            "token from target_probs[b, num_draft_tokens[b]]; pad with -1",
    },
    contract="""
`residual_probs(p, q)`: `max(0, p - q)` normalized over the last dimension (any leading shape);
where nothing is left (`p == q` exactly) it returns `p`, never NaN. `p` and `q` are left untouched.

`rejection_sample(draft_token_ids, num_draft_tokens, target_probs, draft_probs, uniform, sample)`,
for B requests with up to K drafts each (the docstring draws the layout):

- row `b`'s drafts are `draft_token_ids[b, :num_draft_tokens[b]]`; the padding after them may hold
  anything (-1 included) and is never a draft; `num_draft_tokens[b]` may be 0 (a plain decode row);
- draft j of row b is **accepted** when `uniform[b, j] * q(d) < p(d)`, with `p = target_probs[b, j]`,
  `q = draft_probs[b, j]`, or one-hot at the draft when `draft_probs` is None (n-gram drafts: accept
  when `uniform < p(d)`). Only the drafts before the first rejection count;
- then exactly **one more token**: at the first rejected position j, drawn from `residual_probs(p_j,
  q_j)`; if all `num_draft_tokens[b]` drafts were accepted, the **bonus** token, drawn from
  `target_probs[b, num_draft_tokens[b]]`;
- call `sample` **once**, with a `[B, V]` tensor: row b is the distribution of row b's next token
  (`sample` draws each row, a seeded request from its own generator, so the engine's tokens match
  the reference only if it is called once, with every row);
- return `[B, K + 1]` int64: the accepted drafts, the one token, then `PLACEHOLDER_TOKEN_ID` (-1);
- batched: no Python loop over rows or drafts.

A greedy request is the same rule: its target is one-hot at the argmax and its uniform is 0, so a
draft is accepted exactly when it is the argmax, and the residual of a one-hot p is that one-hot.
""",
    hints=(
        """Draw one row of the batch (K = 3, this row has 2 drafts) and ask what each column needs:

    column j            0        1        2 (padding)     3 (bonus position)
    draft d_j           5        2        -1
    p_j(d_j)            ?        ?        (not a draft)
    q_j(d_j)            ?        ?        (1 if draft_probs is None)

Every `?` is one number per (row, column): which tensor holds it, and along which dimension do you
pick entry `d_j`? What must the padding column's "draft" become first, so that picking an entry
with it cannot fail? (A padding id may be -1, or a real id the target happens to like.)""",
        """Once you have a `[B, K]` tensor of True / False, "accepted", how many drafts does each row
keep? Not the number of Trues: a draft after the first rejection never counts.

    accepted    T  T  F  T          -> keeps 2 (the T after the F is ignored)
    accepted    F  T  T  T          -> keeps 0

Which running operation along the row turns `T T F T` into `1 1 0 0`? And once you know how many
a row keeps, which position's distribution gives its one more token, and when is that a residual
rather than p?""",
        """Before you run this, walk the three rows by hand: which drafts are kept (`0.9 * q(d) < p(d)`?),
which distribution gives each row's one more token (a residual, the bonus, or `target[b, 0]`), and
where the -1s go.
```python
# Test case: paste it into a new cell and run it (it uses your functions above)
# 3 requests over 3 tokens, K = 2: row 0 keeps its first draft and rejects its second, row 1 keeps
# both, row 2 has no drafts. "sample" takes the argmax, so you see which distribution was used.
target = torch.tensor([[[0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6]],
                       [[0.1, 0.6, 0.3], [0.1, 0.1, 0.8], [0.7, 0.2, 0.1]],
                       [[0.3, 0.3, 0.4], [1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 1 / 3]]])
drafter = torch.tensor([[[0.2, 0.4, 0.4], [0.25, 0.5, 0.25]],
                        [[0.2, 0.4, 0.4], [0.2, 0.2, 0.6]],
                        [[1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 1 / 3]]])
out = rejection_sample(torch.tensor([[1, 1], [1, 2], [-1, -1]]), torch.tensor([2, 2, 0]), target, drafter,
                       torch.full((3, 2), 0.9), lambda probs: probs.argmax(dim=-1))
assert out.tolist() == [[1, 0, -1], [1, 2, 0], [2, -1, -1]], out
assert residual_probs(torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.25, 0.5, 0.25])).tolist() == [1.0, 0.0, 0.0]
```""",
    ),
    checks=("result = check_rejection_sampler(rejection_sample, residual_probs)",),
    engine_intro="""`components={"rejection_sampler": RejectionSampler}` makes the engine check every
step's drafts with the class above, so with *your* `rejection_sample`. Speculative decoding is on
(`speculative_config={"method": "ngram", "num_speculative_tokens": 3, ...}`: drafts looked up in the
request's own text) for six prompts that repeat themselves, greedy and seeded at several temperatures,
so that some steps keep every draft (a bonus token), some reject one (a token from the residual),
and some requests have no drafts at all. The reference engine runs the same way with its own
sampler: every prompt's tokens must be the same, and at every step the same drafts kept and the same
token after them (the first step that differs is shown, with its drafts).""",
    engine='run_engine_with({"rejection_sampler": RejectionSampler})',
)
