"""Exercise 22 (the batched LoRA ops, ``bgmv_shrink`` and ``bgmv_expand_slice``): the checker
passes the package's ops and names the cause of each usual mistake; the engine cell, a tiny
Llama with two adapters and the base model in one batch, tells a wrong op from the right one."""

import re

import pytest

from microvllm.checks.lora_batch import NOT_SEEN, check_lora_batch, run_lora_with
from microvllm.lora.ops import torch_ops
from microvllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink
from tests.course.mutants import mutant

SHRINK_MASK = "output_tensor.copy_((out * scaling).masked_fill(lora_indices_tensor.unsqueeze(-1) < 0, 0))"
EXPAND_MASK = "out = out.masked_fill(lora_indices_tensor.unsqueeze(-1) < 0, 0).to(output_tensor.dtype)"
NO_MASKS = [(SHRINK_MASK, "output_tensor.copy_(out * scaling)"), (EXPAND_MASK, "out = out.to(output_tensor.dtype)")]
# name: (the replacements that plant the mistake, words its first failure must contain)
MISTAKES = {
    "a token without an adapter gets slot 0": (NO_MASKS, "was given slot 0's adapter"),
    "a token without an adapter gets the last slot": (
        NO_MASKS + [("slots = lora_indices_tensor.clamp(min=0)", "slots = lora_indices_tensor")],
        "was given the last slot's adapter"),
    "the batch's first adapter for every token": (
        [("selected = lora_a_weights[slots].to(inputs.dtype)",
          "selected = lora_a_weights[slots[:1]].expand(len(slots), -1, -1).to(inputs.dtype)")],
        "every token used the adapter of the batch's first token"),
    "the scaling missing": ([("(out * scaling)", "out")], "the scaling is missing"),
    "the scaling inverted": ([("(out * scaling)", "(out / scaling)")], "the scaling is inverted"),
    "A transposed": ([("selected = lora_a_weights[slots].to(inputs.dtype)",
                       "selected = lora_a_weights[slots].transpose(1, 2).to(inputs.dtype)")],
                     "A was used transposed"),
    "B transposed": ([("selected = lora_b_weights[slots].to(inputs.dtype)",
                       "selected = lora_b_weights[slots].transpose(1, 2).to(inputs.dtype)")],
                     "B was used transposed"),
    "the expand ignores add_inputs": ([("    if add_inputs:\n", "    if True:\n")], "add_inputs=True adds"),
    "the expand ignores its offset": (
        [("target = output_tensor[:, slice_offset:slice_offset + slice_size]",
          "target = output_tensor[:, :slice_size]")],
        "the expand wrote outside its slice"),
    "the shrink's -1 mask is missing": ([NO_MASKS[0]], "was given slot 0's adapter"),
    "the expand's -1 mask is missing": ([NO_MASKS[1]], "was given slot 0's adapter"),
    "the shrink's mask written > 0": (
        [(SHRINK_MASK, "output_tensor.copy_(torch.where(lora_indices_tensor.unsqueeze(-1) > 0, out * scaling, 0))")],
        "the tokens of slot 0 got nothing"),
    "the expand's mask written > 0": (
        [(EXPAND_MASK, "out = torch.where(lora_indices_tensor.unsqueeze(-1) > 0, out, 0).to(output_tensor.dtype)")],
        "the tokens of slot 0 got nothing"),
    "the shrink does not cast the slots": (
        [("selected = lora_a_weights[slots].to(inputs.dtype)", "selected = lora_a_weights[slots]")],
        "is the gathered A cast to the inputs' dtype"),
    "the expand does not cast the slots": (
        [("selected = lora_b_weights[slots].to(inputs.dtype) ", "selected = lora_b_weights[slots] ")],
        "is the gathered B cast to the inputs' dtype"),
    "the expand zeroes the base model's rows": (
        NO_MASKS[1:] + [("        target += out\n", "        target += out\n"
                         "        target.masked_fill_(lora_indices_tensor.unsqueeze(-1) < 0, 0)\n")],
        "were set to 0 in the slice"),
    "the overwrite skips the rows of slot -1": (
        [("        target.copy_(out)\n",
          "        keep = lora_indices_tensor >= 0\n        target[keep] = out[keep]\n")],
        "kept what was in the slice"),
    "the shrink adds into its buffer": ([("output_tensor.copy_(", "output_tensor.add_(")],
                                        "does the shrink overwrite output_tensor"),
}
FIRST_CASE = {   # name: the case that must fail first (the one that isolates the mistake)
    "a token without an adapter gets slot 0": "shrink: slot -1 (the base model) gives 0",
    "a token without an adapter gets the last slot": "shrink: slot -1 (the base model) gives 0",
    "the batch's first adapter for every token": "shrink: a mixed batch",
    "the scaling missing": "shrink: the scaling multiplies the result",
    "the scaling inverted": "shrink: the scaling multiplies the result",
    "A transposed": "shrink: A @ x",
    "B transposed": "expand: B @ h",
    "the expand ignores add_inputs": "expand: add_inputs=False overwrites the slice",
    "the expand ignores its offset": "expand: only its slice changes",
    "the shrink's -1 mask is missing": "shrink: slot -1 (the base model) gives 0",
    "the expand's -1 mask is missing": "expand: slot -1 adds nothing",
    "the shrink's mask written > 0": "shrink: one token, one slot",
    "the expand's mask written > 0": "expand: one token, one slot",
    "the shrink does not cast the slots": "dtypes",
    "the expand does not cast the slots": "dtypes",
    "the expand zeroes the base model's rows": "expand: only its slice changes",
    "the shrink adds into its buffer": "shrink: A @ x",
    "the overwrite skips the rows of slot -1": "expand: add_inputs=False overwrites the slice",
}


def planted(name: str):
    module = mutant(torch_ops, MISTAKES[name][0])
    return module.bgmv_shrink, module.bgmv_expand_slice


def test_the_package_passes():
    result = check_lora_batch(bgmv_shrink, bgmv_expand_slice, quiet=True)
    assert result.passed, result.report()


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_each_mistake_is_named_by_its_cause(name):
    result = check_lora_batch(*planted(name), max_examples=20, quiet=True)
    assert not result.passed and not result.not_implemented, f"the checker passed the mutant {name!r}"
    first = result.failures[0].message
    cause = MISTAKES[name][1]
    assert cause in first, f"{name}: the first failure does not name the cause:\n{first}"
    assert "hint:" in first and "input:" in first, first
    others = {words for _, words in MISTAKES.values() if words != cause}
    assert not any(words in first for words in others), f"{name}: the first failure names another cause:\n{first}"
    failed = next(case for case in result.cases if case.status == "fail")
    assert failed.name.startswith(FIRST_CASE[name]), (name, failed.name)


def test_a_todo_is_reported_as_not_implemented():
    def todo(*args, **kwargs):
        raise NotImplementedError("bgmv_shrink: ...")

    result = check_lora_batch(todo, bgmv_expand_slice, quiet=True)
    assert not result.passed and result.not_implemented and "not implemented" in result.report()
    assert "not implemented yet" in run_lora_with(todo, bgmv_expand_slice, quiet=True).message


def test_the_engine_cell_passes_the_package():
    result = run_lora_with(bgmv_shrink, bgmv_expand_slice, quiet=True)
    assert result.same, result.message
    assert result.message.splitlines()[-1].startswith("✓ Same greedy tokens"), result.message
    mixed = re.search(r"\((\d+) calls to your shrink, (\d+) of them on a step with both adapters", result.message)
    assert mixed and int(mixed.group(2)) > 0, result.message
    assert NOT_SEEN in result.message, result.message


# The brief's mistakes, through the engine (each run takes seconds: not all nine).
SEEN_BY_THE_ENGINE = ("a token without an adapter gets slot 0", "the batch's first adapter for every token",
                      "the scaling missing", "the scaling inverted")


@pytest.mark.parametrize("name", SEEN_BY_THE_ENGINE)
def test_the_engine_cells_run_tells_each_mistake(name):
    wrong = run_lora_with(*planted(name), quiet=True)
    assert not wrong.same and wrong.reference != wrong.yours, (name, wrong.message)
    assert "✗ Your tokens differ" in wrong.message, wrong.message


# name: the words of the cell's own case that tells it (the run's tokens cannot: the engine never
# overwrites, its slots are float32, and either op's -1 mask hides the other's)
NOT_SEEN_BY_THE_ENGINE = {
    "the expand ignores add_inputs": "add_inputs=False: wrong output_tensor",
    "the shrink's -1 mask is missing": "slot -1 gives 0 in the shrink: wrong h (a token without an adapter",
    "the expand's -1 mask is missing": "slot -1 adds nothing in the expand: wrong output_tensor (a token without",
    "the shrink does not cast the slots": "float16 slots, float32 inputs: your code raised",
}


@pytest.mark.parametrize("name", sorted(NOT_SEEN_BY_THE_ENGINE))
def test_the_engine_cell_says_what_its_run_cannot_see(name):
    wrong = run_lora_with(*planted(name), quiet=True)
    assert wrong.reference == wrong.yours, wrong.message   # the run itself cannot tell
    assert NOT_SEEN in wrong.message and not wrong.same, wrong.message
    assert "✗ Every token was the same as with the package's ops, but on its own case" in wrong.message, wrong.message
    assert NOT_SEEN_BY_THE_ENGINE[name] in wrong.message, (name, wrong.message)
