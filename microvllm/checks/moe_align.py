"""Checks for exercise 17: the (token, expert) pairs sorted by expert, each expert's run
padded to a block (``layers/fused_moe/moe_align_block_size.py``)::

    T = 3, k = 2, 4 experts, block_size = 4        pairs 0..5 go to experts 2 0 0 1 2 0
    sorted_token_ids  [1 2 5 6 | 3 6 6 6 | 0 4 6 6]  (6 = T*k, padding)
    expert_ids        [0,        1,        2      ]  one per block of 4
    expert_offsets    [0, 4, 8, 12, 12]             expert e's rows: offsets[e] .. offsets[e+1]
    num_tokens_post_padded = 12

The answer is fixed by the contract (stable order, padding at the end of each run), so each
case compares yours with the package's; before that, ``_first_problem`` walks the contract
in the order a reader would (every pair once, the offsets, each run, the padding, the
blocks) and reports the first rule yours breaks, with the usual cause when it is one of the
common ones (token ids stored instead of pair ids, padding written as 0 or -1 instead of
T*k, counts rounded down, a run that is not padded and spills into the next expert's
block, offsets one entry off, an unstable sort, pairs lost after an expert with no pairs,
blocks numbered instead of named by their expert). A function that raises is run again on
simpler inputs to find what makes it raise (the last experts getting no pair: a
``torch.bincount`` without ``minlength``; a count that is not a multiple of
``block_size``: a count rounded down).
"""

from __future__ import annotations

from collections import Counter

import torch

from microvllm.checks.report import (
    Case,
    CheckFailure,
    CheckResult,
    _innermost_user_frame,
    not_implemented_message,
    property_settings,
    run_checks,
    run_property,
)

FIELDS = "AlignedRouting(sorted_token_ids, expert_ids, num_tokens_post_padded, expert_offsets)"

HINT_STABLE = ("the sort must be stable: within one expert, its pairs stay in pair order (pair i before pair j "
               "when i < j). torch.sort and torch.argsort are not stable unless you pass stable=True")
HINT_PLACE = ("each expert's run starts at its own offset, expert_offsets[e], a multiple of block_size: "
              "place its r-th pair at expert_offsets[e] + r, and leave the rest of its last block as padding "
              "(T*k), so that no block holds two experts")
HINT_OFFSETS = ("expert_offsets has E + 1 entries: expert_offsets[0] = 0 and expert_offsets[e + 1] = "
                "expert_offsets[e] + (expert e's pair count rounded up to a multiple of block_size); the last "
                "one is num_tokens_post_padded")


def _reference(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    from microvllm.layers.fused_moe.moe_align_block_size import moe_align_block_size

    return moe_align_block_size(topk_ids, block_size, num_experts)


def _expected_runs(flat: list[int], num_experts: int) -> list[list[int]]:
    """``runs[e]``: the pairs of expert ``e``, in pair order (ids -1 in none)."""
    runs: list[list[int]] = [[] for _ in range(num_experts)]
    for pair, expert in enumerate(flat):
        if expert >= 0:
            runs[expert].append(pair)
    return runs


def _as_list(value, name: str) -> list[int]:
    if not isinstance(value, torch.Tensor):
        raise CheckFailure(f"{name} must be a torch tensor", got=type(value).__name__,
                           hint=f"return {FIELDS}, with num_tokens_post_padded an int and the others "
                                "integer tensors")
    if value.is_floating_point():
        raise CheckFailure(f"{name} must hold integers (torch.long): its entries are indices", got=value.dtype,
                           hint="build it with dtype=torch.long (torch.full, torch.zeros and torch.arange take "
                                "dtype=)")
    return value.flatten().tolist()


def _pairs_text(pairs: list[int], flat: list[int], top_k: int) -> str:
    return ", ".join(f"{p} (token {p // top_k}, expert {flat[p]})" for p in pairs)


def _first_problem(got, topk_ids: torch.Tensor, block_size: int, num_experts: int) -> CheckFailure | None:
    """The first rule of the contract that ``got`` breaks, as a ``CheckFailure``; None if none."""
    flat = topk_ids.flatten().tolist()
    num_pairs, top_k = len(flat), topk_ids.shape[-1]
    pad = num_pairs
    runs = _expected_runs(flat, num_experts)
    padded = [-(-len(run) // block_size) * block_size for run in runs]
    want_offsets = [0]
    for rows in padded:
        want_offsets.append(want_offsets[-1] + rows)

    if not isinstance(got, tuple) or len(got) != 4:
        return CheckFailure(f"moe_align_block_size must return {FIELDS}", got=type(got).__name__,
                            hint="return AlignedRouting(...) (a NamedTuple of those four fields, in that order)")
    sorted_ids = _as_list(got[0], "sorted_token_ids")
    expert_ids = _as_list(got[1], "expert_ids")
    offsets = _as_list(got[3], "expert_offsets")
    total = got[2]
    if isinstance(total, torch.Tensor) and total.numel() == 1:
        total = total.item()

    # 1. Every kept pair exactly once; nothing else but padding.
    kept = {p for p in range(num_pairs) if flat[p] >= 0}
    real = [p for p in sorted_ids if p != pad]
    if top_k > 1 and kept and Counter(real) != Counter(kept) and \
            Counter(real) == Counter(p // top_k for p in kept):
        return CheckFailure("sorted_token_ids holds token ids (pair // k), not pair ids",
                            expected=_want_sorted(runs, padded, pad), got=sorted_ids,
                            hint=f"store the pair index i (0 .. T*k-1 = {num_pairs - 1}), not its token i // k: "
                                 "the kernels need the pair to find its routing weight (topk_weights.flatten()[i]) "
                                 "and its own output row; the token is recovered later as i // k. Sort the pair "
                                 "indices (the positions in topk_ids.flatten()), not the token indices")
    num_padding = want_offsets[-1] - len(kept)
    if num_padding > 0 and pad not in sorted_ids and len(sorted_ids) == want_offsets[-1]:
        value, count = Counter(sorted_ids).most_common(1)[0]
        if count == num_padding + (value in kept):   # every padding row holds the same wrong value
            reads_as = (f"pair {value} (token {value // top_k}, which would be computed again for every padding "
                        "row and added to its output)" if 0 <= value < num_pairs else "no pair, but is not T*k")
            return CheckFailure(f"sorted_token_ids has no padding value T*k = {pad}: its {num_padding} padding "
                                f"rows hold {value}, which reads as {reads_as}",
                                expected=_want_sorted(runs, padded, pad), got=sorted_ids,
                                hint=f"start from a tensor filled with T*k = {pad} (torch.full((total,), T*k, "
                                     "dtype=torch.long)), not torch.zeros or torch.empty, then place the pairs: "
                                     "the padding is one past the last pair, so `pair < T*k` tells a real row "
                                     "from padding")
    left_out = sorted(p for p in set(real) if 0 <= p < num_pairs and flat[p] < 0)
    if left_out:
        return CheckFailure(f"sorted_token_ids holds pair {left_out[0]}, whose expert id is -1",
                            expected=f"pairs {sorted(kept)} once each, and padding {pad}", got=sorted_ids,
                            hint="a pair whose id is -1 goes to an expert another rank holds: leave it out "
                                 "entirely (it is in no run and no block)")
    strange = [p for p in real if not 0 <= p < num_pairs]
    if strange:
        return CheckFailure(f"sorted_token_ids holds {strange[0]}, which is neither a pair (0..{num_pairs - 1}) nor "
                            f"the padding value T*k = {pad}", got=sorted_ids,
                            hint=f"fill every row that holds no pair with T*k = {num_pairs} (one past the last "
                                 "pair: 'no pair here'), not with -1 or 0")
    twice = sorted({p for p in real if real.count(p) > 1})
    if twice:
        return CheckFailure(f"pair {twice[0]} appears {real.count(twice[0])} times in sorted_token_ids",
                            got=sorted_ids, hint="every pair goes to exactly one place: its expert's run")
    missing = sorted(kept - set(real))
    if missing:
        empty = [e for e in range(num_experts) if not runs[e]]
        hint = "every pair whose expert id is not -1 appears exactly once in sorted_token_ids"
        if empty and all(flat[p] > empty[0] for p in missing):
            hint = (f"expert {empty[0]} gets no pair, and pairs of the experts after it are missing: does your "
                    "code stop (break, return) at an expert with no pairs? Such an expert gets an empty run "
                    f"(expert_offsets[{empty[0]}] == expert_offsets[{empty[0] + 1}]) and the experts after it "
                    "still get theirs")
        return CheckFailure(f"pairs missing from sorted_token_ids: {_pairs_text(missing, flat, top_k)}",
                            expected=f"pairs {sorted(kept)} once each, and padding {pad}", got=sorted_ids, hint=hint)

    # 2. The offsets: E + 1 of them, from 0, each run the expert's count padded up.
    if len(offsets) != num_experts + 1:
        return CheckFailure(f"expert_offsets has {len(offsets)} entries; it needs num_experts + 1 = "
                            f"{num_experts + 1}", expected=want_offsets, got=offsets, hint=HINT_OFFSETS)
    if offsets != want_offsets:
        if offsets[:-1] == want_offsets[1:]:
            hint = ("your offsets are one entry early: expert_offsets[e] holds where expert e's run ends. It must "
                    "be where it starts (expert_offsets[0] = 0), and expert_offsets[e + 1] where it ends")
        elif offsets[1:] == want_offsets[:-1]:
            hint = ("your offsets are one entry late: expert_offsets[e + 1] holds where expert e's run starts. "
                    "expert_offsets[0] = 0 is expert 0's start, expert_offsets[e + 1] expert e's end")
        elif [o + d for o, d in zip(offsets, (0, *[1] * num_experts))] == want_offsets or \
                [o - d for o, d in zip(offsets, (0, *[1] * num_experts))] == want_offsets:
            hint = "your offsets are off by one row: " + HINT_OFFSETS
        elif block_size > 1 and offsets == [sum(len(r) for r in runs[:e]) for e in range(num_experts + 1)]:
            hint = ("your offsets count the pairs, not the padded rows: each run is its expert's pair count "
                    f"rounded up to a multiple of block_size = {block_size}")
        elif block_size > 1 and offsets == _cumulative([len(r) // block_size * block_size for r in runs]):
            hint = ("your counts are rounded down (n // b * b), not up: an expert with 3 pairs and block_size 4 "
                    "gets 0 rows. Round up: (n + b - 1) // b * b")
        else:
            hint = HINT_OFFSETS
        expert = next(e for e in range(num_experts + 1) if offsets[e] != want_offsets[e])
        return CheckFailure(f"expert_offsets[{expert}] is {offsets[expert]}, expected {want_offsets[expert]} "
                            f"(pairs per expert: {[len(r) for r in runs]}, block_size = {block_size})",
                            expected=want_offsets, got=offsets, hint=hint)
    if total != want_offsets[-1] or len(sorted_ids) != want_offsets[-1]:
        return CheckFailure(f"num_tokens_post_padded and the length of sorted_token_ids must both be "
                            f"expert_offsets[-1] = {want_offsets[-1]}",
                            expected=want_offsets[-1], got=f"num_tokens_post_padded={total}, "
                                                           f"len(sorted_token_ids)={len(sorted_ids)}",
                            hint="sorted_token_ids holds every expert's padded run, back to back: "
                                 "expert_offsets[-1] rows in all")

    # 3. Each run: the expert's pairs, in pair order, then padding.
    for expert in range(num_experts):
        start, end = offsets[expert], offsets[expert + 1]
        run, want = sorted_ids[start:end], runs[expert] + [pad] * (padded[expert] - len(runs[expert]))
        if run == want:
            continue
        where = f"expert {expert}'s run, rows {start}..{end - 1} (block_size = {block_size})"
        strangers = [p for p in run if p != pad and flat[p] != expert]
        if strangers:
            return CheckFailure(f"{where} holds pair {strangers[0]}, which goes to expert {flat[strangers[0]]}",
                                expected=want, got=run, hint=HINT_PLACE)
        if sorted(p for p in run if p != pad) == runs[expert] and [p for p in run if p != pad] != runs[expert]:
            return CheckFailure(f"{where}: its pairs are out of pair order", expected=want, got=run,
                                hint=HINT_STABLE)
        return CheckFailure(f"{where}: the padding must come after the expert's pairs", expected=want, got=run,
                            hint=f"a run is its expert's pairs first, then T*k = {pad} up to the end of its last "
                                 "block")

    # 4. One expert id per block.
    want_blocks = [e for e in range(num_experts) for _ in range(padded[e] // block_size)]
    if expert_ids != want_blocks:
        hint = ("expert_ids has one entry per block of block_size rows of sorted_token_ids: the expert whose run "
                "that block is part of (an expert with no pairs has no block)")
        if len(expert_ids) == len(sorted_ids) and block_size > 1:
            hint = f"expert_ids has one entry per block of {block_size} rows, not one per row: " + hint
        elif len(expert_ids) == len(want_blocks):
            used = [e for e in range(num_experts) if runs[e]]
            numbered = [used.index(e) for e in want_blocks]
            if expert_ids == numbered:
                hint = (f"your expert_ids number the experts that got pairs (0, 1, 2, ...); each block must hold "
                        f"its expert's own id: here experts {[e for e in range(num_experts) if not runs[e]]} get "
                        "no pair, so the ids after them are not their positions. The kernel loads the weights "
                        "w13[expert_ids[b]] for block b")
        return CheckFailure(f"expert_ids must name the expert of each of the {len(want_blocks)} blocks",
                            expected=want_blocks, got=expert_ids, hint=hint)
    return None


def _cumulative(rows: list[int]) -> list[int]:
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + r)
    return offsets


def _want_sorted(runs: list[list[int]], padded: list[int], pad: int) -> list[int]:
    return [p for run, rows in zip(runs, padded) for p in run + [pad] * (rows - len(run))]


def _runs_on(fn, topk_ids: torch.Tensor, block_size: int, num_experts: int) -> bool:
    """Whether ``fn`` returns (right or wrong) without raising on this input."""
    try:
        fn(topk_ids.clone(), block_size, num_experts)
    except Exception:  # noqa: BLE001 - only whether it raises matters here
        return False
    return True


def _crash(fn, exc: Exception, topk_ids: torch.Tensor, block_size: int, num_experts: int) -> CheckFailure:
    """``fn`` raised ``exc`` on this input: run it on simpler inputs to find what makes it raise."""
    flat = topk_ids.flatten().tolist()
    kept = [e for e in flat if e >= 0]
    used = max(kept) + 1 if kept else 0
    counts = [kept.count(e) for e in range(num_experts)]
    where = _innermost_user_frame(exc)
    got = f"{type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")
    what = "your function raised an exception"
    hint = "run it on this input in a new cell to see which line fails, and print the shapes there"
    if 0 < used < num_experts and _runs_on(fn, topk_ids, block_size, used):
        last = (f"the last expert ({used}) gets" if used == num_experts - 1 else
                f"the last experts ({used}..{num_experts - 1}) get")
        what = f"your function raises when {last} no pair, and runs when num_experts = {used}"
        hint = ("a count per expert with fewer than num_experts entries? torch.bincount(ids) returns max(ids) + 1 "
                "counts, one per value up to the largest it sees: pass minlength=num_experts so that the experts "
                "after the last one used get their 0")
    elif block_size > 1 and any(c % block_size for c in counts) and \
            _runs_on(fn, topk_ids.repeat(block_size, 1), block_size, num_experts):
        what = (f"your function raises when an expert's count is not a multiple of block_size = {block_size} "
                f"(pairs per expert here: {counts}), and runs when every count is one")
        hint = ("are the counts rounded down (n // b * b)? Then an expert with 3 pairs and block_size 4 gets 0 "
                "rows and its pairs have nowhere to go. Round up: (n + b - 1) // b * b")
    elif block_size > 1 and _runs_on(fn, topk_ids, 1, num_experts):
        what = f"your function raises with block_size = {block_size}, and runs with block_size = 1 (no padding)"
        hint = ("look at the padding: each expert's count rounded up to a multiple of block_size, "
                "(n + b - 1) // b * b, and a sorted_token_ids of expert_offsets[-1] rows")
    return CheckFailure(what, got=got, hint=hint)


def _describe(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> str:
    return f"topk_ids={topk_ids.tolist()}, block_size={block_size}, num_experts={num_experts}"


def compare(fn, topk_ids: torch.Tensor, block_size: int, num_experts: int, where: str) -> None:
    """Call ``fn`` on a copy of ``topk_ids``; raise a ``CheckFailure`` naming the first rule it breaks."""
    try:
        got = fn(topk_ids.clone(), block_size, num_experts)
    except Exception as exc:  # noqa: BLE001 - a crash becomes a named cause
        if not_implemented_message(exc) is not None:
            raise
        got, problem = None, _crash(fn, exc, topk_ids, block_size, num_experts)
    else:
        problem = _first_problem(got, topk_ids, block_size, num_experts)
    if problem is None:   # the contract fixes the answer: this only guards the checker itself
        want = _reference(topk_ids, block_size, num_experts)
        if all(torch.equal(torch.as_tensor(g).cpu(), torch.as_tensor(w)) for g, w in zip(got, want)):
            return
        problem = CheckFailure("your result differs from the package's", expected=tuple(want), got=tuple(got))
    problem.what = f"{where}: {problem.what}"
    problem.args = (problem.what,)
    if problem.input is None:
        problem.input = _describe(topk_ids, block_size, num_experts)
    raise problem


def _random_routing(num_tokens: int, top_k: int, num_experts: int, seed: int, left_out: float = 0.0):
    """Each token's ``top_k`` distinct experts (as a router gives them), some -1 when ``left_out``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(dim=-1)[:, :top_k]
    if left_out:
        ids = torch.where(torch.rand(ids.shape, generator=g) < left_out, -1, ids)
    return ids


EXAMPLE = torch.tensor([[2, 0], [0, 1], [2, 0]])   # the docstring's


def check_moe_align(moe_align_block_size, *, max_examples: int = 60, quiet: bool = False) -> CheckResult:
    """Check your ``moe_align_block_size(topk_ids, block_size, num_experts)``; print and
    return the result."""
    fn = moe_align_block_size

    def the_example():
        compare(fn, EXAMPLE, 4, 4, "the docstring's example (T = 3, k = 2, 4 experts, block_size = 4)")

    def empty_experts():
        compare(fn, torch.tensor([[0, 3], [3, 0]]), 2, 5, "experts 1, 2 and 4 get no pair")
        compare(fn, torch.tensor([[5, 4], [4, 5], [5, 4]]), 4, 6, "experts 0-3 get no pair")

    def every_expert():
        ids = torch.tensor([[3, 1, 0, 2], [0, 1, 2, 3], [2, 3, 1, 0]])
        compare(fn, ids, 4, 4, "top_k == num_experts: every token goes to every expert")

    def no_padding():
        compare(fn, EXAMPLE, 1, 4, "block_size = 1: no padding, the pairs sorted by expert")
        compare(fn, torch.tensor([[1, 3]]), 1, 4, "T = 1, block_size = 1")

    def one_token():
        compare(fn, torch.tensor([[1, 3]]), 4, 4, "T = 1 (a decode step with one request)")
        compare(fn, torch.tensor([[2]]), 16, 3, "T = 1, k = 1, block_size = 16")

    def left_out():
        compare(fn, torch.tensor([[2, -1], [-1, 1], [2, 0]]), 4, 4,
                "ids -1 (experts another rank holds) are left out, padding is still T*k")
        compare(fn, torch.tensor([[-1, -1]]), 4, 4, "every id -1: nothing to run")

    def many_pairs():
        # Enough pairs per expert that an unstable sort shows: torch's default sort reorders equal keys.
        compare(fn, _random_routing(64, 2, 4, seed=0), 8, 4, "64 tokens, k = 2, 4 experts, block_size = 8")
        compare(fn, _random_routing(50, 3, 8, seed=1, left_out=0.2), 16, 8,
                "50 tokens, k = 3, 8 experts, block_size = 16, some ids -1")

    def random_routings():
        from hypothesis import given, strategies as st

        @property_settings(max_examples, report_multiple_bugs=False)
        @given(st.integers(1, 24), st.integers(1, 8), st.sampled_from([1, 2, 3, 4, 8, 16]),
               st.integers(0, 2**31 - 1), st.booleans(), st.data())
        def test(num_tokens, num_experts, block_size, seed, with_left_out, data):
            top_k = data.draw(st.integers(1, num_experts), label="top_k")
            ids = _random_routing(num_tokens, top_k, num_experts, seed, 0.25 if with_left_out else 0.0)
            compare(fn, ids, block_size, num_experts,
                    f"random routing (T = {num_tokens}, k = {top_k}, {num_experts} experts, block_size = "
                    f"{block_size})")

        run_property(test)

    cases = [
        Case("the docstring's example: runs, padding, expert_ids, offsets", the_example),
        Case("an expert with no pairs gets no rows and no block", empty_experts),
        Case("top_k == num_experts: every expert gets every token", every_expert),
        Case("block_size 1: nothing is padded", no_padding),
        Case("one token (T = 1)", one_token),
        Case("ids -1 are left out", left_out),
        Case("many pairs per expert: each run keeps pair order (a stable sort)", many_pairs),
        Case(f"property: {max_examples} random routings (every pair once, runs in expert order and stable, "
             "padded to block_size with T*k, one expert id per block, offsets consistent)", random_routings),
    ]
    return run_checks("moe_align_block_size", cases, quiet=quiet)


# --------------------------------------------------------------------- the engine

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Rain forms when", "A B C D E F")
ENGINE_BLOCK_SIZE = 4   # rows per block in the engine run: > 1, so that every run is padded


def experts_by_block(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, block_size: int = ENGINE_BLOCK_SIZE) -> torch.Tensor:
    """The experts run the way the Triton kernel (step c) runs them, in plain torch: block by
    block, each block's rows ``sorted_token_ids[b * block_size : (b + 1) * block_size]`` run
    by the expert ``expert_ids[b]`` names, up to ``num_tokens_post_padded`` rows. Unlike
    ``fused_moe_sorted`` (which finds each expert's rows from ``expert_offsets``), a wrong
    ``expert_ids`` here runs a block with the wrong expert's weights, as it would on a GPU."""
    import microvllm.layers.fused_moe.moe_sorted as moe_sorted
    from microvllm.layers.fused_moe.moe_torch_iterative import expert_mlp

    num_pairs, top_k = topk_ids.numel(), topk_ids.shape[-1]
    # Looked up at each call, so that the engine cell's swap reaches it.
    routing = moe_sorted.moe_align_block_size(topk_ids, block_size, w13.shape[0])
    num_rows = int(routing.num_tokens_post_padded)
    weights = topk_weights.flatten()
    out = torch.zeros_like(hidden)
    for block, expert in enumerate(routing.expert_ids.tolist()):
        if block * block_size >= num_rows:
            break
        pairs = routing.sorted_token_ids[block * block_size:(block + 1) * block_size]
        pairs = pairs[pairs < num_pairs]                  # padding rows are skipped
        if pairs.numel():
            tokens = pairs // top_k
            y = expert_mlp(hidden[tokens], w13[expert], w2[expert])
            out.index_add_(0, tokens, y * weights[pairs, None].to(y.dtype))
    return out


def run_moe_with(moe_align_block_size, *, max_tokens: int = 8, block_size: int = ENGINE_BLOCK_SIZE,
                 quiet: bool = False):
    """Run a tiny random Qwen3-MoE (8 experts, top-2; written to a temporary folder) with
    ``enforce_eager=True``, greedy, its experts run block by block as the Triton kernel runs
    them (``experts_by_block``: every field of your result is read, ``expert_ids`` included),
    twice: with the package's ``moe_align_block_size`` and with yours in its place (both at
    ``block_size`` rows per block); compare the tokens. Returns an ``EngineRunResult``."""
    import functools
    import os
    import tempfile

    import microvllm.layers.fused_moe.layer as moe_layer
    import microvllm.layers.fused_moe.moe_sorted as moe_sorted
    from microvllm import LLM, SamplingParams
    from microvllm.checks.engine_run import EngineRunResult
    from microvllm.models.tiny import make_tiny_model

    def report(same, reference, yours, message):
        if not quiet:
            print(message)
        return EngineRunResult(same, reference, yours, message)

    try:   # the example first: a part not written yet is said in one line, before the engine starts
        fn_result = moe_align_block_size(EXAMPLE.clone(), block_size, 4)
        problem = _first_problem(fn_result, EXAMPLE, block_size, 4)
    except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
        todo = not_implemented_message(exc)
        return report(False, [], [], f"run_moe_with: not implemented yet ({todo})" if todo is not None else
                      f"your moe_align_block_size fails on the docstring's example: {type(exc).__name__}: {exc} "
                      "(run check_moe_align above)")
    if problem is not None:
        return report(False, [], [], f"your moe_align_block_size is wrong on the docstring's example: "
                                     f"{problem.what} (run check_moe_align above)")

    calls, with_empty_expert = [], []

    def yours(topk_ids, block, num_experts):
        calls.append(1)
        kept = topk_ids.flatten()
        counts = torch.bincount(kept[kept >= 0], minlength=num_experts)
        if bool((counts == 0).any()):
            with_empty_expert.append(1)
        return moe_align_block_size(topk_ids, block, num_experts)

    package_align = moe_sorted.moe_align_block_size
    package_sorted = moe_layer.EXPERT_FUNCTIONS["sorted"]
    saved_impl = os.environ.get("MICROVLLM_MOE_IMPL")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    os.environ["MICROVLLM_MOE_IMPL"] = "sorted"
    # The "sorted" experts, run block by block at block_size rows (as the kernel runs them).
    moe_layer.EXPERT_FUNCTIONS["sorted"] = functools.partial(experts_by_block, block_size=block_size)
    try:
        with tempfile.TemporaryDirectory(prefix="microvllm-moe-") as folder:
            make_tiny_model(folder, "qwen3_moe", seed=17)
            llm = LLM(folder, enforce_eager=True, max_model_len=128, kv_cache_memory_bytes=16 << 20)
            reference = [list(o.outputs[0].token_ids) for o in llm.generate(list(PROMPTS), params, use_tqdm=False)]
            moe_sorted.moe_align_block_size = yours
            try:
                got = [list(o.outputs[0].token_ids) for o in llm.generate(list(PROMPTS), params, use_tqdm=False)]
            except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
                return report(False, reference, [], f"✗ The engine stopped on your moe_align_block_size's "
                                                    f"layout: {type(exc).__name__}: {exc} (run check_moe_align "
                                                    "above, which names the first rule yours breaks)")
    finally:
        moe_sorted.moe_align_block_size = package_align
        moe_layer.EXPERT_FUNCTIONS["sorted"] = package_sorted
        if saved_impl is None:
            os.environ.pop("MICROVLLM_MOE_IMPL", None)
        else:
            os.environ["MICROVLLM_MOE_IMPL"] = saved_impl
    lines = [f"A tiny random Qwen3-MoE (8 experts, top-2), enforce_eager=True, the experts run block by block "
             f"(block_size={block_size}, each block by the expert its expert_ids entry names) on your "
             f"moe_align_block_size's layout ({len(calls)} calls, {len(with_empty_expert)} of them with an expert "
             f"that got no pair): {len(PROMPTS)} prompts x {max_tokens} greedy tokens"]
    for prompt, ref, tokens in zip(PROMPTS, reference, got):
        lines.append(f"  {prompt!r}: {'✓' if ref == tokens else '✗'} {tokens}")
        if ref != tokens:
            lines.append(f"      reference: {ref}")
    same = reference == got and bool(calls)
    if not calls:
        lines.append("The engine never called your function: is MICROVLLM_MOE_IMPL set to something else?")
    else:
        lines.append(f"✓ Same greedy tokens as with the package's moe_align_block_size for all {len(PROMPTS)} "
                     "prompts, every block run by the expert your expert_ids names: your layout runs the real "
                     "engine." if same else
                     "✗ Your tokens differ: run check_moe_align above, which names the first rule yours breaks.")
    return report(same, reference, got, "\n".join(lines))
