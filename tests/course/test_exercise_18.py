"""Exercise 18 (gated_delta_step: one token of the gated delta rule): the package's
recurrent form is a loop of it, the checker passes it and names the cause of each usual
mistake, and the engine cell (a tiny Qwen3.5 decoding through it) tells a wrong step from the right
one and puts the package's back, even after an error."""

import importlib
import re

import pytest
import torch

from microvllm.checks.gated_delta import HAND_CASES, check_gated_delta_step, run_gated_deltanet_with
from microvllm.layers.linear_attention.gated_delta_rule import gated_delta_step
from tests.course.mutants import mutant

rule = importlib.import_module("microvllm.layers.linear_attention.gated_delta_rule")

_DECAY = "    S = state.float() * g_t.float().exp()[:, None, None]\n"
_RETURN = '    return torch.einsum("hk,hkv->hv", q_t, S), S\n'
_CORRECTION = "beta_t.float()[:, None] * (v_t.float() - v_old)"

BUGS = {   # name: (replacements in gated_delta_rule.py, words the first failure must contain)
    "decay applied after the write": (
        [(_DECAY, "    S = state.float()\n"),
         (_RETURN, "    S = S * g_t.float().exp()[:, None, None]\n" + _RETURN)],
        "the decay exp(g_t) is applied after the write"),
    "q and k not L2-normalised": (
        [("l2_normalize(q_t.float())", "q_t.float()"), ("l2_normalize(k_t.float())", "k_t.float()")],
        "q_t and k_t are not L2-normalised"),
    "q not scaled by 1/sqrt(d_k)": (
        [(" * q_t.shape[-1] ** -0.5", "")],
        "q_t is not scaled by 1/sqrt(d_k)"),
    "the state not carried (each call starts from zeros)": (
        [(_DECAY, _DECAY.replace("state.float()", "torch.zeros_like(state).float()"))],
        "the state passed in is ignored"),
    "beta on v only, not on the correction": (
        [(_CORRECTION, "beta_t.float()[:, None] * v_t.float() - v_old")],
        "beta_t multiplies v_t only"),
    "output read before the write": (
        [(_RETURN, "    return o_t, S\n"),
         ("    S = S + k_t[:, :, None]", '    o_t = torch.einsum("hk,hkv->hv", q_t, S)\n    S = S + k_t[:, :, None]')],
        "o_t is read from the state before this token's write"),
    "g used as the decay factor, not its log": (
        [(_DECAY, _DECAY.replace("g_t.float().exp()", "g_t.float()"))],
        "g_t is used as the decay factor itself"),
    "the state changed in place": (
        [(_DECAY, "    S = state.mul_(g_t.float().exp()[:, None, None])\n")],
        "changed the state passed in"),
    "o_t read along the wrong axis of S": (
        [(_RETURN, _RETURN.replace('"hk,hkv->hv", q_t', '"hv,hkv->hk", q_t[:, :S.shape[2]]'))],
        "o_t has shape"),
    # issue 54: each of these got a wrong cause or a generic hint before
    "q not L2-normalised (k is)": (
        [("l2_normalize(q_t.float())", "q_t.float()")],
        "q_t is not L2-normalised (k_t is)"),
    "k not L2-normalised (q is)": (
        [("l2_normalize(k_t.float())", "k_t.float()")],
        "k_t is not L2-normalised (q_t is)"),
    "key heads tiled with repeat, not repeat_interleave": (
        [(".repeat_interleave(group, dim=0)", ".repeat(group, 1)")],
        "repeated as [a, b, a, b] (repeat), not [a, a, b, b] (repeat_interleave)"),
    "plain linear attention: v written, not the correction": (
        [(_CORRECTION, "beta_t.float()[:, None] * v_t.float()")],
        "plain linear attention, not the delta rule"),
    "v_old recalled from the undecayed state": (
        [('v_old = torch.einsum("hk,hkv->hv", k_t, S)', 'v_old = torch.einsum("hk,hkv->hv", k_t, state.float())')],
        "v_old is recalled from the state before the decay"),
    "the write transposed: v k^T, not k v^T": (
        [("k_t[:, :, None] * correction[:, None, :]", "correction[:, :, None] * k_t[:, None, :]")],
        "a d_k axis (4) met a d_v axis (2): S is [H_v, d_k, d_v], so the write is k c^T"),
}
FIRST_CASE = {   # the hand case built for the mistake is the first to fail
    "q not L2-normalised (k is)": "by hand: an empty state",
    "k not L2-normalised (q is)": "by hand: an empty state",
    "key heads tiled with repeat, not repeat_interleave": "by hand: two key heads for four value heads",
    "plain linear attention: v written, not the correction": "by hand: the delta rule writes the correction",
    "v_old recalled from the undecayed state": "by hand: the decay comes first",
    "the write transposed: v k^T, not k v^T": "by hand: an empty state",
}
MUTANTS = {name: mutant(rule, replacements).gated_delta_step for name, (replacements, _) in BUGS.items()}


def test_the_recurrent_form_is_a_loop_of_the_step(monkeypatch):
    calls = []
    monkeypatch.setattr(rule, "gated_delta_step", lambda *args: calls.append(1) or gated_delta_step(*args))
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    v, g, beta = torch.randn(5, 4, 6, generator=gen), -torch.rand(5, 4, generator=gen), torch.rand(5, 4, generator=gen)
    o, state = rule.recurrent_gated_delta_rule(q, k, v, g, beta)
    assert len(calls) == 5
    want_o, want_state = rule.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=2)
    torch.testing.assert_close(o, want_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-5)


def test_the_hand_cases_are_the_packages_answers():
    for name, inputs, want_o, want_s in HAND_CASES:
        o, s = gated_delta_step(*inputs)
        torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(s, want_s, rtol=1e-5, atol=1e-5, msg=name)


def test_the_package_passes():
    result = check_gated_delta_step(gated_delta_step, quiet=True)
    assert result.passed, result.report()


@pytest.mark.parametrize("name", sorted(BUGS))
def test_each_mistake_is_named_by_its_cause(name):
    result = check_gated_delta_step(MUTANTS[name], quiet=True)
    assert not result.passed and not result.not_implemented, f"the checker passed the mutant {name!r}"
    first = result.failures[0].message
    assert BUGS[name][1] in first, f"{name}: the first failure does not name the cause:\n{first}"
    assert "hint:" in first and "input:" in first, first
    if name in FIRST_CASE:
        assert result.failures[0].name.startswith(FIRST_CASE[name]), result.report()
        assert "work the case through by hand" not in first, first   # not the generic hint


def test_a_transposed_write_is_explained_with_the_shapes():
    # the shape error comes back as a failure with the line that raised it, not as a crash
    result = check_gated_delta_step(MUTANTS["the write transposed: v k^T, not k v^T"], quiet=True)
    first = result.failures[0].message
    assert re.search(r"raised RuntimeError.*got: .*line \d+: S = S \+ correction\[:, :, None\]", first, re.S), first
    assert "not c k^T (v k^T, [H_v, d_v, d_k])" in first, first


@pytest.mark.parametrize("name", ["the state not carried (each call starts from zeros)",
                                  "decay applied after the write"])
def test_the_property_alone_catches_a_mistake(name):
    """Without the hand cases, the loop against the chunked form still fails the mutant."""
    from microvllm.checks.gated_delta import compare_with_chunked
    from microvllm.checks.report import CheckFailure

    with pytest.raises(CheckFailure):
        compare_with_chunked(MUTANTS[name], 4, 1, 2, 4, 3, (3, 2), 4, "test")


def test_a_todo_is_reported_as_not_implemented():
    def todo(*args, **kwargs):
        raise NotImplementedError("gated_delta_step: ...")

    result = check_gated_delta_step(todo, quiet=True)
    assert not result.passed and result.not_implemented and "not implemented" in result.report()
    assert "not implemented yet" in run_gated_deltanet_with(todo, quiet=True).message


def calls_in(message: str) -> int:
    found = re.search(r"\((\d+) calls", message)
    return int(found.group(1)) if found else 0


def test_the_engine_cell_tells_a_wrong_step_from_the_right_one():
    result = run_gated_deltanet_with(gated_delta_step, max_tokens=3, quiet=True)
    assert result.same and calls_in(result.message) > 0, result.message
    assert result.message.splitlines()[-1].startswith("✓ Same greedy tokens and log-probabilities"), result.message
    assert len(result.reference) == 3 and all(len(tokens) == 3 for tokens in result.reference)
    # the first hand case already fails this one: told before the engine starts
    early = run_gated_deltanet_with(MUTANTS["q not scaled by 1/sqrt(d_k)"], quiet=True)
    assert not early.same and "check_gated_delta_step" in early.message, early.message

    # passes the first hand case (an empty state, g = 0), wrong in the engine
    wrong = run_gated_deltanet_with(MUTANTS["decay applied after the write"], max_tokens=3, quiet=True)
    assert not wrong.same and "✗" in wrong.message and "check_gated_delta_step" in wrong.message, wrong.message
    assert wrong.message.splitlines()[-1].startswith("✗ Your tokens differ"), wrong.message
    assert calls_in(wrong.message) > 0
    assert rule.gated_delta_step is gated_delta_step   # the package's step is put back


def test_the_packages_step_is_put_back_after_an_error():
    def broken(*args):
        if args[-1].abs().sum() > 0:   # passes the first hand case (a zero state), fails in the engine
            raise RuntimeError("broken on purpose")
        return gated_delta_step(*args)

    result = run_gated_deltanet_with(broken, max_tokens=2, quiet=True)
    assert not result.same and "broken on purpose" in result.message, result.message
    assert rule.gated_delta_step is gated_delta_step
