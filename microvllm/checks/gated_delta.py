"""Checks for exercise 18: one token of the gated delta rule, every head at once
(``gated_delta_step`` in ``layers/linear_attention/gated_delta_rule.py``)::

    q_t, k_t [H_k, d_k]   v_t [H_v, d_v]   g_t, beta_t [H_v]   state [H_v, d_k, d_v]
    q, k L2-normalised, q times d_k^-1/2, key head h serving value heads h*group ..
    S <- exp(g_t) S;  S <- S + k (beta (v - S^T k))^T;  o_t = S^T q   ->  (o_t, S)

First small cases worked out by hand (a 4 x 2 state, round numbers), each built so that one
usual mistake changes the answer; then a property test: your step in a loop over fresh random
inputs, from a random state, must give the outputs and the final state of the package's
*chunked* form (``chunk_gated_delta_rule``, a different algorithm: a triangular solve per
chunk), the state carried from one call to the next. A wrong answer is compared with what
each usual mistake would return (q or k not normalised, q not scaled, plain linear attention
(no correction), beta on v alone, the decay after the write, the recall from the undecayed
state, the state ignored, the output read before the write, exp(g) forgotten, key heads
repeated as [a, b, a, b]), and the matching one is named with what to change. A shape error
inside your step is explained with the shapes (a d_k axis meeting a d_v axis: v k^T written
for k v^T).
"""

from __future__ import annotations

import math
import re

import torch

from microvllm.checks.report import (
    Case,
    CheckFailure,
    CheckResult,
    not_implemented_message,
    property_settings,
    run_checks,
    run_property,
)

ATOL, RTOL = 1e-5, 1e-4


# ------------------------------------------------------------------- the usual mistakes


def _step(q, k, v, g, beta, state, *, gate_after=False, normalize_q=True, normalize_k=True, scale=True,
          from_zeros=False, no_delta=False, beta_on_v=False, recall_undecayed=False, read_before=False,
          g_is_factor=False, tiled=False):
    """The rule, or one usual mistake in it (the checker's own, to name what a wrong answer did)."""
    from microvllm.layers.linear_attention.gated_delta_rule import l2_normalize

    group = v.shape[0] // k.shape[0]
    q, k, v, g, beta = q.float(), k.float(), v.float(), g.float(), beta.float()
    if normalize_q:
        q = l2_normalize(q)
    if normalize_k:
        k = l2_normalize(k)
    if scale:
        q = q * q.shape[-1] ** -0.5
    if tiled:    # [a, b] -> [a, b, a, b]: value head h reads key head h % H_k (the mistake)
        q, k = q.repeat(group, 1), k.repeat(group, 1)
    else:        # [a, b] -> [a, a, b, b]: value head h reads key head h // group
        q, k = q.repeat_interleave(group, dim=0), k.repeat_interleave(group, dim=0)
    S = torch.zeros_like(state, dtype=torch.float32) if from_zeros else state.float()
    undecayed = S
    decay = (g if g_is_factor else g.exp())[:, None, None]
    if not gate_after:
        S = S * decay
    before = torch.einsum("hk,hkv->hv", q, S)
    v_old = torch.einsum("hk,hkv->hv", k, undecayed if recall_undecayed else S)
    if no_delta:
        correction = beta[:, None] * v
    elif beta_on_v:
        correction = beta[:, None] * v - v_old
    else:
        correction = beta[:, None] * (v - v_old)
    S = S + k[:, :, None] * correction[:, None, :]
    if gate_after:
        S = S * decay
    return (before if read_before else torch.einsum("hk,hkv->hv", q, S)), S


MISTAKES = (   # (keywords of _step that make the mistake, what it is, what to change)
    ({"normalize_q": False, "normalize_k": False}, "q_t and k_t are not L2-normalised",
     "normalise each head's q and k to length 1 first (l2_normalize, over d_k); the layer hands them over raw"),
    ({"normalize_q": False}, "q_t is not L2-normalised (k_t is)",
     "normalise q as well as k (l2_normalize over d_k), then scale q by d_k ** -0.5: how much a query reads "
     "must not depend on its length"),
    ({"normalize_k": False}, "k_t is not L2-normalised (q_t is)",
     "normalise k as well as q (l2_normalize over d_k, but no scale): the write makes k recall v exactly only when "
     "k has length 1"),
    ({"scale": False}, "q_t is not scaled by 1/sqrt(d_k)",
     "after normalising, multiply q by d_k ** -0.5 (k is not scaled), as attention scales its scores"),
    ({"no_delta": True}, "the write adds beta_t v_t, not the correction beta_t (v_t - v_old): plain linear "
     "attention, not the delta rule",
     "recall first, v_old = S^T k_t (what the decayed state already holds for this key), then write "
     "k_t (beta_t (v_t - v_old))^T: when S already recalls v_t for k_t, the write adds nothing"),
    ({"beta_on_v": True}, "beta_t multiplies v_t only, not the correction v_t - v_old",
     "the delta rule writes beta * (v_t - v_old): beta scales the whole correction, so beta = 1 replaces what key "
     "k_t recalled, and beta = 0 writes nothing"),
    ({"gate_after": True}, "the decay exp(g_t) is applied after the write, not before it",
     "forget first: S = exp(g_t) * S, then compute v_old = S^T k_t from the decayed S and write the correction"),
    ({"recall_undecayed": True}, "v_old is recalled from the state before the decay (the write corrects what "
     "the undecayed state recalled)",
     "decay first, S = exp(g_t) * state, then recall v_old = S^T k_t from that same decayed S: the correction is "
     "what the forgetful state lacks, so that with beta = 1 key k_t then recalls v_t exactly"),
    ({"from_zeros": True}, "the state passed in is ignored: the step starts from zeros",
     "start from the state argument (the previous token's state): a request's memory is that state, carried from "
     "one call to the next"),
    ({"read_before": True}, "o_t is read from the state before this token's write",
     "read with the query after the update: o_t = S^T q_t with the new S (the token sees itself, as attention's "
     "causal mask includes the diagonal)"),
    ({"g_is_factor": True}, "g_t is used as the decay factor itself, not as its log",
     "g_t <= 0 is a log decay: multiply the state by exp(g_t), a number in (0, 1]"),
    ({"tiled": True}, "the key heads are repeated as [a, b, a, b] (repeat), not [a, a, b, b] (repeat_interleave)",
     "a key head's value heads are adjacent: key head h serves value heads h*group .. h*group + group - 1, so "
     "repeat each row in place, x.repeat_interleave(group, dim=0), not x.repeat(group, 1) (which tiles the "
     "whole block: value head 1 would read key head 1)"),
)


def _close(got, want) -> bool:
    return got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=RTOL, atol=ATOL)


def _diagnose(got_o, got_s, inputs) -> list[tuple[str, str]]:
    """(what was done, hint) of each usual mistake whose answer equals ``got`` (on some inputs
    two give the same answer: with g = 0, exp(g) forgotten also zeroes the state)."""
    found = []
    for keywords, what, hint in MISTAKES:
        o, s = _step(*inputs, **keywords)
        if _close(got_o, o) and _close(got_s, s):
            found.append((what, hint))
    return found


def _fmt(x: torch.Tensor) -> str:
    return str([[round(v, 4) for v in row] for row in x.float().reshape(x.shape[0], -1).tolist()]) \
        if x.dim() > 1 else str([round(v, 4) for v in x.float().tolist()])


def _describe(q, k, v, g, beta, state) -> str:
    return (f"q_t={_fmt(q)}, k_t={_fmt(k)}, v_t={_fmt(v)}, g_t={_fmt(g)}, beta_t={_fmt(beta)}, "
            f"state={_fmt(state)} (each head's d_k x d_v matrix flattened)")


def _raised(exc: Exception, inputs) -> CheckFailure:
    """An error raised inside the learner's step (a shape error, mostly), with this input's
    shapes; when a d_k axis met a d_v axis, the likely cause: v k^T written for k v^T."""
    from microvllm.checks.report import explain_exception

    q, k, v, g, beta, state = inputs
    d_k, d_v = k.shape[-1], v.shape[-1]
    said, *where = explain_exception(exc)
    sizes = {int(n) for group in re.findall(r"\((\d+)\)|size (\d+)|\[(\d+(?:, \d+)*)\]", str(exc))
             for part in group if part for n in part.split(", ")}
    hint = (f"the shapes here: q_t, k_t {list(q.shape)}, v_t {list(v.shape)}, state {list(state.shape)}. Per value "
            "head S is [d_k, d_v]: the recall S^T k and the read S^T q sum over its d_k axis (dim 1 of "
            "[H_v, d_k, d_v]), and the write k c^T is [d_k, d_v] like S")
    if d_k != d_v and {d_k, d_v} <= sizes:
        hint = (f"a d_k axis ({d_k}) met a d_v axis ({d_v}): S is [H_v, d_k, d_v], so the write is k c^T, "
                "k_t[:, :, None] * c[:, None, :] ([H_v, d_k, 1] * [H_v, 1, d_v]), not c k^T (v k^T, "
                "[H_v, d_v, d_k]); the recall S^T k and the read S^T q sum over S's d_k axis (dim 1)")
    said = said.removeprefix("your code raised ")
    if where:
        said += f" (in {where[0].removeprefix('at:').strip()})"
    return CheckFailure(f"your gated_delta_step raised {type(exc).__name__}", input=_describe(*inputs), got=said,
                        hint=hint)


def _call(fn, inputs):
    q, k, v, g, beta, state = inputs
    given = state.clone()
    try:
        result = fn(*(x.clone() for x in inputs[:5]), given)
    except NotImplementedError:   # a part not written yet: reported as such
        raise
    except (RuntimeError, IndexError, ValueError, TypeError) as exc:
        raise _raised(exc, inputs) from exc
    if not isinstance(result, tuple) or len(result) != 2:
        raise CheckFailure("gated_delta_step must return a pair (o_t, new_state)", got=type(result).__name__,
                           hint="return o_t, S (the output [H_v, d_v] and the new state [H_v, d_k, d_v])")
    o, s = result
    for name, value, shape in (("o_t", o, (v.shape[0], v.shape[1])), ("the new state", s, tuple(state.shape))):
        if not isinstance(value, torch.Tensor):
            raise CheckFailure(f"{name} must be a torch tensor", got=type(value).__name__)
        if tuple(value.shape) != shape:
            hint = ("o_t has one row per value head, H_v = v_t.shape[0]; with H_k < H_v key heads, repeat each "
                    "key head for the H_v / H_k value heads it serves (repeat_interleave)")
            if name == "o_t" and tuple(value.shape) == (v.shape[0], state.shape[1]) and state.shape[1] != v.shape[1]:
                hint = ("o_t = S^T q_t is [H_v, d_v]: contract q with S's d_k axis (einsum 'hk,hkv->hv'), "
                        "not its d_v axis")
            raise CheckFailure(f"{name} has shape {tuple(value.shape)}, expected {shape}",
                               input=_describe(*inputs), hint=hint)
    if s.dtype != torch.float32:
        raise CheckFailure(f"the new state must be float32, got {s.dtype}", input=_describe(*inputs),
                           hint="compute in float32 (.float() on every input): the state adds up thousands of "
                                "small writes, and bfloat16 would lose them")
    if not torch.equal(given, state):
        raise CheckFailure("your step changed the state passed in (in place)", input=_describe(*inputs),
                           hint="build a new tensor (S = state * ..., not state *= ... or state.mul_(...)): the "
                                "engine may keep the old state, e.g. as a prefix-cache snapshot")
    return o, s


def compare(fn, inputs, want_o, want_s, where: str) -> None:
    """Call ``fn`` on copies of ``inputs``; raise a ``CheckFailure`` unless it returns
    (``want_o``, ``want_s``) within float32 rounding, naming the usual mistake it matches."""
    try:
        got_o, got_s = _call(fn, inputs)
    except CheckFailure as problem:
        problem.what = f"{where}: {problem.what}"
        problem.args = (problem.what,)
        raise
    if _close(got_o, want_o) and _close(got_s, want_s):
        return
    which = "o_t and the new state" if not _close(got_s, want_s) and not _close(got_o, want_o) else \
        ("the new state" if not _close(got_s, want_s) else "o_t")
    diagnosis = _diagnose(got_o, got_s, inputs)
    what = f"{where}: {which} {'are' if which.startswith('o_t and') else 'is'} wrong"
    hint = "work the case through by hand with the four lines of the contract, in their order"
    if len(diagnosis) == 1:
        what += f" ({diagnosis[0][0]})"
        hint = diagnosis[0][1]
    elif diagnosis:
        what += " (on this input, any of these mistakes gives your answer: " + \
            "; or ".join(w for w, _ in diagnosis) + ")"
        hint = " | or: ".join(h for _, h in diagnosis)
    raise CheckFailure(what, input=_describe(*inputs),
                       expected=f"o_t={_fmt(want_o)}, state={_fmt(want_s)}",
                       got=f"o_t={_fmt(got_o)}, state={_fmt(got_s)}", hint=hint)


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


HALF = math.log(0.5)

# (name, inputs (q, k, v, g, beta, state), expected o_t, expected state): worked out by hand.
# One head unless said; d_k = 4 so that q's scale is 1/2; d_v = 2. Each case is built so that
# the mistakes before it in the list change nothing, and the one it names changes the answer.
HAND_CASES = (
    ("an empty state, beta = 1: the state becomes k v^T (k = [2, 0, 0, 0] normalised), and q = [3, 0, 0, 0] "
     "(normalised, times 1/sqrt(d_k) = 1/2) reads half of it back",
     (_t([[3, 0, 0, 0]]), _t([[2, 0, 0, 0]]), _t([[1, 2]]), _t([0]), _t([1]), torch.zeros(1, 4, 2)),
     _t([[0.5, 1]]), _t([[[1, 2], [0, 0], [0, 0], [0, 0]]])),
    ("q and k are normalised first (k = [0, 3, 4, 0] has length 5, q = [0, 0, 0, 5] too), q scaled by 1/2",
     (_t([[0, 0, 0, 5]]), _t([[0, 3, 4, 0]]), _t([[5, 10]]), _t([0]), _t([1]), _t([[[0, 0], [0, 0], [0, 0], [4, 4]]])),
     _t([[2, 2]]), _t([[[0, 0], [3, 6], [4, 8], [4, 4]]])),
    ("the delta rule writes the correction: S recalls [2, 1] for k, v = [3, 1], so it writes [1, 0] "
     "(plain linear attention would add all of v)",
     (_t([[2, 0, 0, 0]]), _t([[1, 0, 0, 0]]), _t([[3, 1]]), _t([0]), _t([1]), _t([[[2, 1], [0, 0], [0, 0], [0, 0]]])),
     _t([[1.5, 0.5]]), _t([[[3, 1], [0, 0], [0, 0], [0, 0]]])),
    ("beta scales the whole correction: S recalls 1 for k, v = 3, beta = 1/2 writes half of 3 - 1",
     (_t([[2, 0, 0, 0]]), _t([[1, 0, 0, 0]]), _t([[3, 0]]), _t([0]), _t([0.5]), _t([[[1, 0], [0, 0], [0, 0], [0, 1]]])),
     _t([[1, 0]]), _t([[[2, 0], [0, 0], [0, 0], [0, 1]]])),
    ("the decay comes first: exp(g) = 1/2 halves the state, then the write corrects what the halved state recalls "
     "(2 / 2 = 1, not 2)",
     (_t([[0, 0, 0, 1]]), _t([[1, 0, 0, 0]]), _t([[4, 0]]), _t([HALF]), _t([1]),
      _t([[[2, 0], [0, 0], [0, 0], [0, 2]]])),
     _t([[0, 0.5]]), _t([[[4, 0], [0, 0], [0, 0], [0, 1]]])),
    ("the state passed in is where the step starts: beta = 0 writes nothing, so o_t reads the decayed state",
     (_t([[0, 2, 0, 0]]), _t([[1, 0, 0, 0]]), _t([[7, 7]]), _t([HALF]), _t([0]),
      _t([[[0, 0], [6, 2], [0, 0], [0, 0]]])),
     _t([[1.5, 0.5]]), _t([[[0, 0], [3, 1], [0, 0], [0, 0]]])),
    ("two value heads share one key head (H_k = 1, H_v = 2): each has its own v, g, beta and state",
     (_t([[1, 0, 0, 0]]), _t([[1, 0, 0, 0]]), _t([[2, 0], [0, 4]]), _t([0, HALF]), _t([1, 0.5]),
      _t([[[0, 0], [0, 0], [0, 0], [0, 0]], [[0, 4], [0, 0], [0, 0], [0, 0]]])),
     _t([[1, 0], [0, 1.5]]), _t([[[2, 0], [0, 0], [0, 0], [0, 0]], [[0, 3], [0, 0], [0, 0], [0, 0]]])),
    ("two key heads for four value heads (group = 2): value heads 0, 1 read key head 0, and value heads 2, 3 "
     "key head 1",
     (_t([[2, 0, 0, 0], [0, 2, 0, 0]]), _t([[1, 0, 0, 0], [0, 1, 0, 0]]), _t([[2, 0], [4, 0], [0, 2], [0, 4]]),
      _t([0, 0, 0, 0]), _t([1, 1, 1, 1]), torch.zeros(4, 4, 2)),
     _t([[1, 0], [2, 0], [0, 1], [0, 2]]),
     _t([[[2, 0], [0, 0], [0, 0], [0, 0]], [[4, 0], [0, 0], [0, 0], [0, 0]],
         [[0, 0], [0, 2], [0, 0], [0, 0]], [[0, 0], [0, 4], [0, 0], [0, 0]]])),
)


def _random_inputs(gen, H_k, group, d_k, d_v, T, dtype=torch.float32):
    H_v = H_k * group
    q = torch.randn(T, H_k, d_k, generator=gen)
    k = torch.randn(T, H_k, d_k, generator=gen)
    v = torch.randn(T, H_v, d_v, generator=gen)
    g = -torch.rand(T, H_v, generator=gen)               # log decays in (-1, 0]
    beta = torch.rand(T, H_v, generator=gen)
    state = torch.randn(H_v, d_k, d_v, generator=gen)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta)) + (state,)


def compare_with_chunked(fn, seed, H_k, group, d_k, d_v, lengths, chunk_size, where) -> None:
    """``fn`` in a loop over ``sum(lengths)`` tokens from a random state, as several calls of
    ``lengths`` tokens each (the state carried), against ``chunk_gated_delta_rule``."""
    from microvllm.layers.linear_attention.gated_delta_rule import chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta, state = _random_inputs(gen, H_k, group, d_k, d_v, sum(lengths))
    want_o, want_s = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk_size)
    S, start = state, 0
    for length in lengths:
        for t in range(start, start + length):
            inputs = (q[t], k[t], v[t], g[t], beta[t], S)
            o_t, S_next = _call(fn, inputs)
            want_step = _step(*inputs)
            if not (_close(o_t, want_o[t]) and _close(S_next, want_step[1])):
                compare(fn, inputs, want_o[t], want_step[1],
                        f"{where}: token {t} (of {sum(lengths)}, calls of {list(lengths)} tokens)")
            S = S_next
        start += length
    if not _close(S, want_s):
        raise CheckFailure(f"{where}: the state after {sum(lengths)} tokens differs from the chunked form's",
                           expected=_fmt(want_s[0]), got=_fmt(S[0]),
                           hint="each token's step must start from the state the previous one returned")


def check_gated_delta_step(gated_delta_step, *, max_examples: int = 25, quiet: bool = False) -> CheckResult:
    """Check your ``gated_delta_step(q_t, k_t, v_t, g_t, beta_t, state) -> (o_t, new_state)``;
    print and return the result."""
    fn = gated_delta_step

    def hand_case(index):
        def run():
            name, inputs, want_o, want_s = HAND_CASES[index]
            compare(fn, inputs, want_o, want_s, "by hand")
        return run

    def bfloat16_inputs():
        gen = torch.Generator().manual_seed(3)
        q, k, v, g, beta, state = _random_inputs(gen, 2, 2, 8, 4, 1, dtype=torch.bfloat16)
        inputs = (q[0], k[0], v[0], g[0], beta[0], state)
        compare(fn, inputs, *_step(*inputs), "bfloat16 q, k, v, g, beta (as the model gives them), float32 state")

    def loop_equals_chunked():
        compare_with_chunked(fn, 0, 2, 2, 8, 6, (20,), 8, "20 tokens, 2 key heads for 4 value heads")
        compare_with_chunked(fn, 1, 1, 3, 16, 4, (7, 1, 1, 5), 4,
                             "a prefill of 7 tokens, 2 decode steps, 5 more: the state carried across calls")

    def random_shapes():
        from hypothesis import given, strategies as st

        @property_settings(max_examples, report_multiple_bugs=False)
        @given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.integers(1, 3), st.integers(1, 9),
               st.integers(1, 7), st.lists(st.integers(1, 6), min_size=1, max_size=3), st.sampled_from([2, 4, 64]))
        def test(seed, H_k, group, d_k, d_v, lengths, chunk_size):
            compare_with_chunked(fn, seed, H_k, group, d_k, d_v, tuple(lengths), chunk_size,
                                 f"random inputs (H_k = {H_k}, H_v = {H_k * group}, d_k = {d_k}, d_v = {d_v})")

        run_property(test)

    cases = [Case(f"by hand: {name}", hand_case(i)) for i, (name, *_rest) in enumerate(HAND_CASES)]
    cases += [
        Case("bfloat16 inputs: computed in float32, the state returned in float32", bfloat16_inputs),
        Case("a loop of your steps equals chunk_gated_delta_rule (outputs and final state)", loop_equals_chunked),
        Case(f"property: {max_examples} random shapes and splits, your loop against the chunked form",
             random_shapes),
    ]
    return run_checks("gated_delta_step", cases, quiet=quiet)


# --------------------------------------------------------------------- the layer


PROMPT_LENGTHS = (5, 23, 41)   # token ids, no tokenizer; the longer two prefilled in chunks
ENGINE_BUDGET = 16             # max_num_batched_tokens: chunked prefill beside decode steps


def _prompt(index: int, length: int) -> list[int]:
    return [(37 * index + 11 * i) % 500 + 3 for i in range(length)]


def run_gated_deltanet_with(gated_delta_step, *, max_tokens: int = 8, quiet: bool = False):
    """Run the engine on a tiny random Qwen3.5 (3 Gated DeltaNet layers beside 1 gated full
    attention, twice; written to a temporary folder), ``enforce_eager=True``, greedy, on 3
    prompts with chunked prefill (``max_num_batched_tokens=16``), twice: with the package's
    ``gated_delta_step`` and with yours in its place in
    ``microvllm.layers.linear_attention.gated_delta_rule`` (put back afterwards, even on an
    error). Decode steps go through ``recurrent_gated_delta_rule``, a loop of your function;
    prefill chunks go through the chunked form. Compares the tokens and their log-probabilities
    (a tiny random model's greedy tokens can survive a small error) and counts the calls to
    yours. Returns an ``EngineRunResult`` (the package's tokens and yours)."""
    import tempfile

    import microvllm.layers.linear_attention.gated_delta_rule as rule
    from microvllm import LLM, SamplingParams
    from microvllm.checks.engine_run import EngineRunResult, _quiet
    from microvllm.models.tiny import make_tiny_model

    def report(same, reference, yours, message):
        if not quiet:
            print(message)
        return EngineRunResult(same, reference, yours, message)

    try:   # a part not written yet is said in one line, before the engine starts
        name, inputs, want_o, want_s = HAND_CASES[0]
        compare(gated_delta_step, inputs, want_o, want_s, "the first hand case")
    except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
        todo = not_implemented_message(exc)
        return report(False, [], [], f"run_gated_deltanet_with: not implemented yet ({todo})" if todo is not None
                      else f"your gated_delta_step fails the first hand case: {exc} (run check_gated_delta_step "
                           "above)")

    calls = []

    def yours(*args):
        calls.append(1)
        return gated_delta_step(*args)

    prompts = [{"prompt_token_ids": _prompt(i, n)} for i, n in enumerate(PROMPT_LENGTHS)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)

    def generate(llm):
        llm.reset_prefix_cache()    # every run computes its prompts itself: no state from the other run
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [[step[token].logprob for token, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                    for o in outs]
        return tokens, logprobs

    package = rule.gated_delta_step
    with tempfile.TemporaryDirectory(prefix="microvllm-qwen3_5-") as folder:
        with _quiet():
            make_tiny_model(folder, "qwen3_5", seed=18, tokenizer=False)
            llm = LLM(folder, enforce_eager=True, dtype="float32", max_model_len=128,
                      max_num_batched_tokens=ENGINE_BUDGET, kv_cache_memory_bytes=16 << 20)
        reference, reference_logprobs = generate(llm)
        rule.gated_delta_step = yours
        try:
            got, got_logprobs = generate(llm)
        except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
            return report(False, reference, [], f"The engine stopped inside your gated_delta_step: "
                                                f"{type(exc).__name__}: {exc}")
        finally:
            rule.gated_delta_step = package
    worst = max((abs(a - b) for ref, mine in zip(reference_logprobs, got_logprobs) for a, b in zip(ref, mine)),
                default=0.0)
    close = worst <= 1e-4
    lines = [f"A tiny random Qwen3.5 in the engine (6 Gated DeltaNet layers beside 2 of gated full attention), "
             f"enforce_eager=True, chunked prefill ({ENGINE_BUDGET} tokens a step): {len(prompts)} prompts x "
             f"{max_tokens} greedy tokens, with your gated_delta_step ({len(calls)} calls: each decode step runs it "
             "once per request and Gated DeltaNet layer)"]
    for prompt, ref, tokens in zip(PROMPT_LENGTHS, reference, got):
        lines.append(f"  a prompt of {prompt:2} tokens: {'✓' if ref == tokens else '✗'} {tokens}")
        if ref != tokens:
            lines.append(f"      the package's: {ref}")
    lines.append(f"  largest difference of a generated token's log-probability from the package's run: {worst:.2g}")
    same = reference == got and close and bool(calls)
    if not calls:
        lines.append("✗ The engine never called your gated_delta_step.")
    elif same:
        lines.append("✓ Same greedy tokens and log-probabilities as the package's gated_delta_step (whose tokens "
                     "equal Hugging Face's generate): your step runs the real engine's decode.")
    else:
        lines.append(("✗ Your tokens differ" if reference != got else
                      "✗ The same tokens, but the log-probabilities differ: a smaller error, that a larger model "
                      "would turn into other tokens") + ": run check_gated_delta_step above, which names the usual "
                     "mistake yours makes.")
    return report(same, reference, got, "\n".join(lines))
