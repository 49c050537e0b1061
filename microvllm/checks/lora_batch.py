"""Checks for exercise 22: the batched LoRA ops for a step whose tokens run with different
adapters (``lora/ops/torch_ops.py``)::

    idx [T]           1   1  -1   0   0        each token's slot, -1: the base model
    shrink   h[t]  = scaling * lora_a[idx[t]] @ x[t]        lora_a [L, rank, in]
    expand   y[t, off:off+n] += lora_b[idx[t]] @ h[t]       lora_b [L, n, rank]

Small integer-valued tensors make every exact case exact in floating point; each compares
yours with the per-token formula and, when they differ, ``_first_problem`` tries the usual
mistakes on the same input and names the one yours computed: the scaling missing or
inverted, a token without an adapter given slot 0 (a clamp without the mask) or the last
slot (indexing with -1), one adapter for the whole batch (the first token's) instead of each
token's own, ``A`` or ``B`` used transposed (on a square case; a non-square one raises and
is explained by the shapes), the expand writing outside its slice or ignoring
``add_inputs``. A hypothesis property then holds both ops against a per-token loop on random
mixed batches. ``run_lora_with`` swaps yours into the real engine.
"""

from __future__ import annotations

from collections.abc import Callable

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

HINT_SCALING_MISSING = ("the scaling is missing: the shrink's result is scaling * (A[slot] @ x[t]) (lora_alpha / r; "
                        "the engine passes 1.0 because it folded it into B)")
HINT_SCALING_INVERTED = "the scaling is inverted: multiply the shrink's result by scaling, do not divide by it"
HINT_SLOT_ZERO = ("a token without an adapter (slot -1) was given slot 0's adapter: clamping -1 to 0 makes the "
                  "gather legal, but those rows must then be set to 0 (masked_fill or torch.where on idx < 0)")
HINT_SLOT_LAST = ("a token without an adapter (slot -1) was given the last slot's adapter: indexing a tensor with "
                  "-1 picks its last entry; those rows must be 0 (mask them with idx < 0)")
HINT_ONE_ADAPTER = ("every token used the adapter of the batch's first token: in a mixed batch each token t "
                    "uses its own slot, lora_indices_tensor[t] (gather lora_weights[lora_indices_tensor])")
HINT_A_TRANSPOSED = ("A was used transposed: lora_a_weights[s] is [rank, in] (peft's lora_A.weight) and the "
                     "shrink is A @ x[t], not x[t] @ A (torch.bmm(A_selected, x[:, :, None]))")
HINT_B_TRANSPOSED = ("B was used transposed: lora_b_weights[s] is [slice_size, rank] (peft's lora_B.weight) and "
                     "the expand is B @ h[t], not h[t] @ B")
HINT_SHAPES_A = ("check the shapes: inputs [T, in], lora_a_weights [max_loras, rank, in], output [T, rank]; "
                 "A[slot] @ x[t] is torch.bmm(lora_a_weights[idx] [T, rank, in], inputs[:, :, None] [T, in, 1])")
HINT_SHAPES_B = ("check the shapes: inputs [T, rank], lora_b_weights [max_loras, slice_size, rank], output "
                 "[T, out]; B[slot] @ h[t] is torch.bmm(lora_b_weights[idx] [T, slice_size, rank], "
                 "inputs[:, :, None])")
HINT_OFFSET = ("the expand wrote outside its slice: only columns slice_offset .. slice_offset + slice_size - 1 of "
               "output_tensor change (a merged qkv_proj has three slices; each call writes one)")
HINT_ADD_INPUTS = ("add_inputs=True adds into the slice (the layer's base output is there already); "
                   "add_inputs=False overwrites it")
HINT_SLOT_ZERO_MASKED = ("the tokens of slot 0 got nothing, as if they had no adapter: slot 0 is an adapter like any "
                         "other, only -1 means the base model; does your mask test idx < 0 (not idx > 0 or idx <= 0)?")
HINT_BASE_ROWS_ZEROED = ("the rows of the tokens without an adapter (slot -1) were set to 0 in the slice, losing what "
                         "was there (the base model's output): with add_inputs=True they get nothing added; is the -1 "
                         "mask applied to B @ h before it is added, rather than to output_tensor after?")
HINT_OVERWRITE_KEPT = ("with add_inputs=False the rows of the tokens without an adapter (slot -1) kept what was in the "
                       "slice: overwriting writes every row of the slice, zeros where idx is -1; does your write "
                       "cover the rows of slot -1 too?")
HINT_DTYPE_A = ("your code mixed float16 and float32, which torch.bmm refuses: the slots may be stored in another "
                "dtype than the activations; is the gathered A cast to the inputs' dtype (.to(inputs.dtype)) before "
                "the product?")
HINT_DTYPE_B = ("your code mixed float16 and float32, which torch.bmm refuses: the slots may be stored in another "
                "dtype than the activations; is the gathered B cast to the inputs' dtype before the product, and the "
                "result to output_tensor's dtype before it is written?")
HINT_ADDED_INTO = ("output_tensor came back NaN where it should hold h: the shrink's output buffer is not zeroed "
                   "(the engine makes it with torch.empty), and yours added into it; does the shrink overwrite "
                   "output_tensor (copy_) rather than add to it?")
HINT_ROWS = ("none of the usual mistakes gives your answer: which rows differ from the expected ones, and what do "
             "those tokens' slots (lora_indices_tensor) have in common? Work one of them out by hand: "
             "{formula}")
HINT_IN_PLACE = "write the result into output_tensor in place (output_tensor.copy_(...) or +=): the op returns nothing"


def _shrink_formula(x, a, idx, scaling):
    """The per-token loop: what the shrink must give (and the wrong answers, from other inputs)."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype)
    for t, slot in enumerate(idx.tolist()):
        if slot >= 0:
            out[t] = scaling * (a[slot].to(x.dtype) @ x[t])
    return out


def _expand_formula(h, b, y, idx, offset, size, add_inputs):
    out = y.clone()
    for t, slot in enumerate(idx.tolist()):
        value = b[slot].to(h.dtype) @ h[t] if slot >= 0 else torch.zeros(size, dtype=h.dtype)
        if add_inputs:
            out[t, offset:offset + size] += value.to(y.dtype)
        else:
            out[t, offset:offset + size] = value.to(y.dtype)
    return out


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=1e-5, atol=1e-5)


def _describe(**tensors) -> str:
    parts = []
    for name, value in tensors.items():
        parts.append(f"{name}={value.tolist() if isinstance(value, torch.Tensor) else value}")
    return ", ".join(parts)


def _one_adapter(idx: torch.Tensor) -> torch.Tensor:
    return torch.full_like(idx, int(idx[0]))


def _slot_zero_as_base(idx: torch.Tensor) -> torch.Tensor:
    """Slot 0 taken for "no adapter" (a mask written idx > 0)."""
    return idx.where(idx != 0, -1)


def _dtype_mixed(exc: Exception) -> bool:
    text = str(exc)
    return "scalar type" in text or "dtype" in text or ("Half" in text and "Float" in text)


def _shrink_problem(got, x, a, idx, scaling) -> str | None:
    """The hint of the usual mistake ``got`` equals, or None."""
    last = a.shape[0] - 1
    candidates = [
        (HINT_SLOT_ZERO_MASKED, lambda: _shrink_formula(x, a, _slot_zero_as_base(idx), scaling),
         bool((idx == 0).any())),
        (HINT_SCALING_MISSING, lambda: _shrink_formula(x, a, idx, 1.0), scaling != 1.0),
        (HINT_SCALING_INVERTED, lambda: _shrink_formula(x, a, idx, 1.0 / scaling), scaling != 1.0),
        (HINT_SLOT_ZERO, lambda: _shrink_formula(x, a, idx.clamp(min=0), scaling), bool((idx < 0).any())),
        (HINT_SLOT_LAST, lambda: _shrink_formula(x, a, idx.where(idx >= 0, last), scaling),
         bool((idx < 0).any()) and last > 0),
        (HINT_ONE_ADAPTER, lambda: _shrink_formula(x, a, _one_adapter(idx), scaling), len(set(idx.tolist())) > 1),
        (HINT_A_TRANSPOSED, lambda: _shrink_formula(x, a.transpose(1, 2), idx, scaling), a.shape[1] == a.shape[2]),
    ]
    for hint, wrong, applies in candidates:
        if applies and _same(got, wrong()):
            return hint
    return None


def _expand_problem(got, h, b, y, idx, offset, size, add_inputs) -> str | None:
    last = b.shape[0] - 1
    based = y.clone()
    based[idx < 0, offset:offset + size] = 0

    def kept():   # the overwrite skipping the rows of slot -1
        out = _expand_formula(h, b, y, idx, offset, size, add_inputs)
        out[idx < 0, offset:offset + size] = y[idx < 0, offset:offset + size]
        return out

    candidates = [
        (HINT_SLOT_ZERO_MASKED, lambda: _expand_formula(h, b, y, _slot_zero_as_base(idx), offset, size, add_inputs),
         bool((idx == 0).any())),
        (HINT_SLOT_ZERO, lambda: _expand_formula(h, b, y, idx.clamp(min=0), offset, size, add_inputs),
         bool((idx < 0).any())),
        (HINT_BASE_ROWS_ZEROED, lambda: _expand_formula(h, b, based, idx, offset, size, add_inputs),
         add_inputs and bool(y[idx < 0, offset:offset + size].any())),
        (HINT_OVERWRITE_KEPT, kept, not add_inputs and bool(y[idx < 0, offset:offset + size].any())),
        (HINT_SLOT_LAST, lambda: _expand_formula(h, b, y, idx.where(idx >= 0, last), offset, size, add_inputs),
         bool((idx < 0).any()) and last > 0),
        (HINT_ONE_ADAPTER, lambda: _expand_formula(h, b, y, _one_adapter(idx), offset, size, add_inputs),
         len(set(idx.tolist())) > 1),
        (HINT_B_TRANSPOSED, lambda: _expand_formula(h, b.transpose(1, 2), y, idx, offset, size, add_inputs),
         b.shape[1] == b.shape[2]),
        (HINT_ADD_INPUTS, lambda: _expand_formula(h, b, y, idx, offset, size, not add_inputs), bool(y.any())),
        (HINT_OFFSET, lambda: _expand_formula(h, b, y, idx, 0, size, add_inputs), offset > 0),
    ]
    for hint, wrong, applies in candidates:
        if applies and _same(got, wrong()):
            return hint
    return None


def compare_shrink(fn, x, a, idx, scaling, where: str) -> None:
    want = _shrink_formula(x, a, idx, scaling)
    out = torch.full_like(want, float("nan"))
    shown = _describe(inputs=x, lora_a_weights=a, lora_indices_tensor=idx, scaling=scaling)
    try:
        returned = fn(x.clone(), a.clone(), out, idx.clone(), scaling=scaling)
    except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
        if not_implemented_message(exc) is not None:
            raise
        raise CheckFailure(f"bgmv_shrink, {where}: your code raised {type(exc).__name__}: {exc}", input=shown,
                           hint=HINT_DTYPE_A if _dtype_mixed(exc) else HINT_SHAPES_A) from exc
    if torch.isnan(out).any():
        got = returned if isinstance(returned, torch.Tensor) else out
        zeroed = torch.zeros_like(want)
        try:
            fn(x.clone(), a.clone(), zeroed, idx.clone(), scaling=scaling)
        except Exception:  # noqa: BLE001 - only asked whether a zeroed buffer gives h
            zeroed = out
        if _same(zeroed, want):   # right on a zeroed buffer: it adds into output_tensor
            raise CheckFailure(f"bgmv_shrink, {where}: output_tensor is NaN (it was filled with NaN before the call)",
                               input=shown, expected=want.tolist(), got=got.tolist(), hint=HINT_ADDED_INTO)
        raise CheckFailure(f"bgmv_shrink, {where}: output_tensor was not written", input=shown, expected=want.tolist(),
                           got=got.tolist(), hint=HINT_IN_PLACE)
    if not _same(out, want):
        raise CheckFailure(f"bgmv_shrink, {where}: wrong h", input=shown, expected=want.tolist(), got=out.tolist(),
                           hint=_shrink_problem(out, x, a, idx, scaling)
                           or HINT_ROWS.format(formula="h[t] = scaling * A[slot] @ x[t], 0 where slot is -1"))


def compare_expand(fn, h, b, y, idx, offset, size, add_inputs, where: str) -> None:
    want = _expand_formula(h, b, y, idx, offset, size, add_inputs)
    out = y.clone()
    shown = _describe(inputs=h, lora_b_weights=b, output_tensor=y, lora_indices_tensor=idx, slice_offset=offset,
                      slice_size=size, add_inputs=add_inputs)
    try:
        fn(h.clone(), b.clone(), out, idx.clone(), offset, size, add_inputs=add_inputs)
    except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
        if not_implemented_message(exc) is not None:
            raise
        raise CheckFailure(f"bgmv_expand_slice, {where}: your code raised {type(exc).__name__}: {exc}", input=shown,
                           hint=HINT_DTYPE_B if _dtype_mixed(exc) else HINT_SHAPES_B) from exc
    if not _same(out, want):
        hint = _expand_problem(out, h, b, y, idx, offset, size, add_inputs)
        if hint is None and torch.equal(out, y) and not torch.equal(want, y):
            hint = HINT_IN_PLACE
        hint = hint or HINT_ROWS.format(formula="y[t, slice] (+)= B[slot] @ h[t], nothing (or zeros) where slot is -1")
        raise CheckFailure(f"bgmv_expand_slice, {where}: wrong output_tensor", input=shown, expected=want.tolist(),
                           got=out.tolist(), hint=hint)


def _ints(*shape: int, seed: int, low: int = -3, high: int = 4) -> torch.Tensor:
    """Small integers as float32: every product and sum below is exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).float()


def check_lora_batch(bgmv_shrink: Callable, bgmv_expand_slice: Callable, *, max_examples: int = 60,
                     quiet: bool = False) -> CheckResult:
    """Check your ``bgmv_shrink`` and ``bgmv_expand_slice``; print and return the result."""
    shrink, expand = bgmv_shrink, bgmv_expand_slice
    a3 = _ints(3, 2, 3, seed=1)             # 3 slots, rank 2, in 3
    b3 = _ints(3, 4, 2, seed=2)             # 3 slots, slice 4, rank 2
    x = _ints(5, 3, seed=3)
    h = _ints(5, 2, seed=4)

    def shrink_one_token():
        compare_shrink(shrink, x[:1], a3[:1], torch.tensor([0]), 1.0, "one token, one slot, scaling 1")

    def shrink_square():   # slot 1 of 2: slot 0 has cases of its own
        a = torch.tensor([[[0., 0.], [0., 0.]], [[1., 2.], [0., 1.]]])
        compare_shrink(shrink, torch.tensor([[1., 0.]]), a, torch.tensor([1]), 1.0,
                       "A is [rank, in]: a square A must not be used transposed")

    def shrink_scaling():
        compare_shrink(shrink, x[:2], a3[:1], torch.tensor([0, 0]), 0.5, "scaling 0.5")
        compare_shrink(shrink, x[:2], a3[:1], torch.tensor([0, 0]), 4.0, "scaling 4")

    def shrink_mixed():
        compare_shrink(shrink, x, a3, torch.tensor([1, 1, 2, 0, 0]), 1.0, "each token with its own slot")

    def shrink_base():
        compare_shrink(shrink, x, a3, torch.tensor([1, 1, -1, 0, 0]), 1.0, "a token without an adapter (-1)")
        compare_shrink(shrink, x[:2], a3, torch.tensor([-1, -1]), 2.0, "no token with an adapter")

    def expand_one_token():
        compare_expand(expand, h[:1], b3[:1], torch.zeros(1, 4), torch.tensor([0]), 0, 4, True,
                       "one token, one slot, the whole output")

    def expand_square():
        b = torch.tensor([[[0., 0.], [0., 0.]], [[1., 2.], [0., 1.]]])
        compare_expand(expand, torch.tensor([[1., 0.]]), b, torch.zeros(1, 2), torch.tensor([1]), 0, 2, True,
                       "B is [slice_size, rank]: a square B must not be used transposed")

    def expand_mixed():
        compare_expand(expand, h, b3, torch.zeros(5, 4), torch.tensor([1, 1, 2, 0, 0]), 0, 4, True,
                       "each token with its own slot")

    def expand_base():
        compare_expand(expand, h, b3, torch.zeros(5, 4), torch.tensor([1, 1, -1, 0, 0]), 0, 4, True,
                       "a token without an adapter (-1) gets nothing")

    def expand_slice():
        y = _ints(5, 10, seed=5)
        compare_expand(expand, h, b3, y, torch.tensor([1, 1, -1, 0, 0]), 4, 4, True,
                       "columns 4..7 of 10 (the second slice of a merged layer), added to what is there")

    def expand_overwrite():
        y = _ints(5, 10, seed=6)
        compare_expand(expand, h, b3, y, torch.tensor([1, 1, -1, 0, 0]), 2, 4, False,
                       "add_inputs=False overwrites the slice (zeros where -1)")

    def dtypes():
        a = a3.half()
        compare_shrink(shrink, x, a, torch.tensor([2, -1, 0, 1, 0]), 0.5,
                       "float16 slots, float32 inputs: compute in the inputs' dtype")
        compare_expand(expand, h, b3.half(), torch.zeros(5, 6), torch.tensor([2, -1, 0, 1, 0]), 1, 4, True,
                       "float16 slots, float32 inputs and output")

    def random_batches():
        from hypothesis import given, strategies as st

        @property_settings(max_examples, report_multiple_bugs=False)
        @given(st.integers(1, 12), st.integers(1, 4), st.integers(1, 4), st.integers(1, 6),
               st.lists(st.integers(1, 5), min_size=1, max_size=3), st.sampled_from([1.0, 0.5, 2.0, 0.25]),
               st.booleans(), st.integers(0, 2**31 - 1), st.data())
        def test(num_tokens, num_slots, rank, in_features, slices, scaling, add_inputs, seed, data):
            idx = torch.tensor(data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=num_tokens,
                                                  max_size=num_tokens), label="lora_indices_tensor"))
            x_ = _ints(num_tokens, in_features, seed=seed)
            a = _ints(num_slots, rank, in_features, seed=seed + 1)
            where = (f"random mixed batch (T = {num_tokens}, {num_slots} slots, rank {rank}, slices {slices}, "
                     f"scaling {scaling}, add_inputs {add_inputs})")
            compare_shrink(shrink, x_, a, idx, scaling, where)
            h_ = _shrink_formula(x_, a, idx, scaling)
            y = _ints(num_tokens, sum(slices), seed=seed + 2)
            offset = 0
            for i, size in enumerate(slices):   # one call per slice, as a merged layer does
                b = _ints(num_slots, size, rank, seed=seed + 3 + i)
                compare_expand(expand, h_, b, y, idx, offset, size, add_inputs, where + f", slice {i}")
                y = _expand_formula(h_, b, y, idx, offset, size, add_inputs)
                offset += size

        run_property(test)

    cases = [
        Case("shrink: A @ x with A [rank, in]", shrink_square),
        Case("shrink: one token, one slot", shrink_one_token),
        Case("shrink: the scaling multiplies the result", shrink_scaling),
        Case("shrink: a mixed batch, each token its own slot", shrink_mixed),
        Case("shrink: slot -1 (the base model) gives 0", shrink_base),
        Case("expand: B @ h with B [slice_size, rank]", expand_square),
        Case("expand: one token, one slot", expand_one_token),
        Case("expand: a mixed batch, each token its own slot", expand_mixed),
        Case("expand: slot -1 adds nothing", expand_base),
        Case("expand: only its slice changes", expand_slice),
        Case("expand: add_inputs=False overwrites the slice", expand_overwrite),
        Case("dtypes: float16 slots, float32 activations", dtypes),
        Case(f"property: {max_examples} random mixed batches against a per-token loop (shrink, then the "
             "expand of each slice)", random_batches),
    ]
    return run_checks("bgmv_shrink and bgmv_expand_slice", cases, quiet=quiet)


# --------------------------------------------------------------------- the engine

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Rain forms when")
NOT_SEEN = ("What the run cannot see: the engine's expand always adds into the layer's output (add_inputs=True); "
            "its slots have the activations' dtype (a missing cast never meets float16); and a token without an "
            "adapter (slot -1) is zeroed by either op, so one op wrong there is hidden by the other right one. "
            "The cell runs those cases on your ops directly.")
ENGINE_SCALING = 2.0   # the scaling your shrink gets in the engine run (a power of 2: halving it back is exact)


def _side_case_problem(bgmv_shrink: Callable, bgmv_expand_slice: Callable) -> str | None:
    """The rules the engine run cannot see (``NOT_SEEN``), one case each on your ops: the
    first one broken, said with its hint, or None."""
    x, a = torch.tensor([[1., 2.], [3., 4.]]), torch.tensor([[[1., 0.], [0., 1.]]])
    h, b = torch.tensor([[1., 2.], [3., 4.]]), torch.tensor([[[1., 0.], [0., 1.]]])
    cases = (
        lambda: compare_shrink(bgmv_shrink, x, a, torch.tensor([0, -1]), 1.0, "slot -1 gives 0 in the shrink"),
        lambda: compare_expand(bgmv_expand_slice, h, b, torch.ones(2, 4), torch.tensor([0, -1]), 1, 2, True,
                               "slot -1 adds nothing in the expand"),
        lambda: compare_shrink(bgmv_shrink, x, a.half(), torch.tensor([0, -1]), 1.0,
                               "float16 slots, float32 inputs"),
        lambda: compare_expand(bgmv_expand_slice, h, b.half(), torch.ones(2, 4), torch.tensor([0, -1]), 1, 2, True,
                               "float16 slots, float32 inputs and output"),
        lambda: compare_expand(bgmv_expand_slice, h, b, torch.ones(2, 4), torch.tensor([0, -1]), 1, 2, False,
                               "add_inputs=False"),
    )
    for case in cases:
        try:
            case()
        except CheckFailure as failure:
            return failure.what + (f" ({failure.hint})" if failure.hint else "")
    return None


def make_tiny_lora_model(folder, names: tuple[str, ...] = ("adapter1", "adapter2"), rank: int = 4):
    """A tiny random Llama and one peft adapter of it per name (random A and B of rank
    ``rank`` on every projection, ``lora_alpha = 2 * rank``), written under ``folder`` with
    nothing printed; returns (the model's folder, [LoRARequest]), the i-th with id ``i + 1``."""
    import warnings
    from pathlib import Path

    from transformers.utils import logging as hf_logging

    from microvllm.bench.lora import make_adapters
    from microvllm.lora.request import LoRARequest
    from microvllm.models.tiny import make_tiny_model

    model = make_tiny_model(Path(folder) / "model", "llama", seed=22)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()   # "Loading weights" on stderr would clutter notebooks
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            paths = make_adapters(model, len(names), rank, Path(folder))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model, [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(zip(names, paths))]


def run_lora_with(bgmv_shrink: Callable, bgmv_expand_slice: Callable, *, max_tokens: int = 8,
                  quiet: bool = False):
    """Run a tiny random Llama with two peft adapters (made here, offline) and
    ``enable_lora=True``, greedy: three prompts in one batch, the first with adapter 1, the
    second with adapter 2, the third with the base model, twice: with the package's ops and
    with yours in their place (``PunicaWrapperCPU`` calls them for every wrapped layer).
    Your shrink is called with ``scaling=2.0`` and its result halved, so that the run sees
    the scaling (the engine's own is folded into B: it passes 1.0). Returns an
    ``EngineRunResult``."""
    import tempfile

    import microvllm.lora.punica_wrapper as punica
    from microvllm import LLM, SamplingParams
    from microvllm.checks.engine_run import EngineRunResult

    def report(same, reference, yours, message):
        if not quiet:
            print(message)
        return EngineRunResult(same, reference, yours, message)

    try:   # a part not written yet is said in one line, before the engine starts
        bgmv_shrink(torch.ones(1, 2), torch.ones(1, 1, 2), torch.empty(1, 1), torch.tensor([0]))
        bgmv_expand_slice(torch.ones(1, 1), torch.ones(1, 2, 1), torch.zeros(1, 2), torch.tensor([0]), 0, 2)
    except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
        todo = not_implemented_message(exc)
        return report(False, [], [], f"run_lora_with: not implemented yet ({todo})" if todo is not None else
                      f"your ops fail on one token: {type(exc).__name__}: {exc} (run check_lora_batch above)")

    calls, mixed = [], []

    def shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        calls.append(1)
        slots = set(lora_indices_tensor.tolist())
        if -1 in slots and len(slots) >= 3:
            mixed.append(1)
        bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=scaling * ENGINE_SCALING)
        output_tensor.div_(ENGINE_SCALING)

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    package_shrink, package_expand = punica.bgmv_shrink, punica.bgmv_expand_slice
    try:
        with tempfile.TemporaryDirectory(prefix="microvllm-lora-") as folder:
            model, adapters = make_tiny_lora_model(folder)
            llm = LLM(str(model), enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128,
                      kv_cache_memory_bytes=16 << 20)
            loras = [adapters[0], adapters[1], None]

            def generate():
                outs = llm.generate(list(PROMPTS), params, use_tqdm=False, lora_request=loras)
                return [list(o.outputs[0].token_ids) for o in outs]

            reference = generate()
            punica.bgmv_shrink, punica.bgmv_expand_slice = shrink, bgmv_expand_slice
            try:
                got = generate()
            except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
                return report(False, reference, [], f"✗ The engine stopped in your ops: {type(exc).__name__}: "
                                                    f"{exc} (run check_lora_batch above)")
    finally:
        punica.bgmv_shrink, punica.bgmv_expand_slice = package_shrink, package_expand
    names = ("adapter1", "adapter2", "the base model")
    lines = [f"A tiny random Llama with two peft adapters (rank 4, every projection), enable_lora=True, one batch "
             f"of {len(PROMPTS)} prompts x {max_tokens} greedy tokens ({len(calls)} calls to your shrink, "
             f"{len(mixed)} of them on a step with both adapters and the base model)"]
    for prompt, name, ref, tokens in zip(PROMPTS, names, reference, got):
        lines.append(f"  {prompt!r} with {name}: {'✓' if ref == tokens else '✗'} {tokens}")
        if ref != tokens:
            lines.append(f"      reference: {ref}")
    overwrite_problem = _side_case_problem(bgmv_shrink, bgmv_expand_slice)
    lines.append(NOT_SEEN)
    same = reference == got and bool(mixed) and overwrite_problem is None
    if not calls:
        lines.append("The engine never called your ops.")
    elif reference == got and overwrite_problem is not None:
        lines.append(f"✗ Every token was the same as with the package's ops, but on its own case: {overwrite_problem} "
                     "(run check_lora_batch above, which names the rule).")
    else:
        lines.append("✓ Same greedy tokens as with the package's ops for both adapters and the base model in one "
                     "batch: your batched LoRA runs the real engine." if same else
                     "✗ Your tokens differ: run check_lora_batch above, which names the first rule yours breaks.")
    return report(same, reference, got, "\n".join(lines))
