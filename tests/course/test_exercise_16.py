"""Exercise 16 (a Q4_1 block from its bytes, and back): the checker passes the package's
functions and names the real cause of each usual mistake; the engine cell tells them apart."""

import pytest

import microvllm.layers.quantization.gguf as gguf_format
from microvllm.checks.quantization import check_q4_1, run_gguf_with
from tests.course.mutants import mutant

DEQUANTIZE_LINE = "    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()"
SCALE_LINES = ("    d = blocks[..., 0:2].contiguous().view(torch.float16).float()      # [N, blocks, 1]\n"
               "    m = blocks[..., 2:4].contiguous().view(torch.float16).float()\n")

MUTANTS = {
    # name: (replacements in gguf.py, which function is wrong, words the failure must contain)
    "nibble order swapped": (
        [(DEQUANTIZE_LINE, DEQUANTIZE_LINE.replace("[qs & 0x0F, qs >> 4]", "[qs >> 4, qs & 0x0F]"))],
        "dequantize", "LOW 4 bits"),
    "min ignored": (
        [("    weights = d * q + m\n", "    weights = d * q\n")], "dequantize", "minimum m is left out"),
    "fp16 read as bf16": (
        [(SCALE_LINES, SCALE_LINES.replace("torch.float16", "torch.bfloat16"))], "dequantize", "bfloat16"),
    "scale from max only": (
        [("    d = (blocks.amax(dim=-1, keepdim=True) - low) / 15\n",
          "    d = blocks.amax(dim=-1, keepdim=True) / 15\n")], "quantize", "max / 15"),
    "quantize packs the nibbles the other way": (
        [("    packed = q[..., :half] | (q[..., half:] << 4)\n",
          "    packed = (q[..., :half] << 4) | q[..., half:]\n")],
        "quantize", "LOW 4 bits"),
    "quantize truncates instead of rounding": (
        [("torch.trunc((blocks - low) * inverse + 0.5)", "torch.trunc((blocks - low) * inverse)")],
        "quantize", "truncated instead of rounded"),
}


def _functions(name):
    replacements, _, _ = MUTANTS[name]
    copy = mutant(gguf_format, replacements)
    return copy.dequantize_q4_1, copy.quantize_q4_1


def test_the_package_passes():
    result = check_q4_1(gguf_format.dequantize_q4_1, gguf_format.quantize_q4_1, quiet=True)
    assert result.passed, result.report()


@pytest.mark.parametrize("name", MUTANTS)
def test_each_mistake_is_named_by_its_cause(name):
    dequantize, quantize = _functions(name)
    _, which, words = MUTANTS[name]
    if which == "quantize":   # the learner's quantize beside the package's dequantize, and the other way round
        dequantize = gguf_format.dequantize_q4_1
    else:
        quantize = gguf_format.quantize_q4_1
    result = check_q4_1(dequantize, quantize, quiet=True)
    assert not result.passed, f"the checker passed the mutant {name!r}"
    first = result.failures[0].message
    assert words in first, f"{name}: the first failure does not name the cause ({words!r}):\n{first}"


def test_a_todo_is_reported_as_not_implemented():
    def todo(*args, **kwargs):
        raise NotImplementedError("dequantize_q4_1: ...")

    result = check_q4_1(todo, gguf_format.quantize_q4_1, quiet=True)
    assert not result.passed and "not implemented" in result.report()


@pytest.mark.slow   # the embedded model, eager, four times: a few minutes on a loaded 2-core machine
def test_the_engine_cell_tells_a_wrong_dequantization_from_the_right_one():
    assert run_gguf_with(gguf_format.dequantize_q4_1, max_tokens=2, quiet=True).same
    dequantize, _ = _functions("nibble order swapped")
    result = run_gguf_with(dequantize, max_tokens=2, quiet=True)
    assert not result.same and "check_q4_1" in result.message
    assert gguf_format.DEQUANTIZE["Q4_1"] is gguf_format.dequantize_q4_1   # the package's is put back
