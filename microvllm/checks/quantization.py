"""Checks for exercise 16: a Q4_1 block from its bytes, and back (``layers/quantization/gguf.py``).

    byte   0-1     2-3     4        5        ...  4+B/2-1          (B = 32 in a GGUF file)
           d fp16  m fp16  q0|q16   q1|q17   ...  q15|q31          low nibble | high nibble
    w[i] = d * q[i] + m

The references: the package's own functions, llama.cpp's numpy port in the ``gguf`` package
(``gguf.quants.quantize``, byte for byte at B = 32), and the embedded GGUF file's blocks,
which re-quantize to themselves. A wrong answer is compared with the wrong answers that the
usual mistakes give (nibbles the other way round, ``m`` left out, d and m read as bfloat16,
d from the maximum alone, ...) and the one it equals is named.
"""

from __future__ import annotations

import numpy as np
import torch

from microvllm.checks.report import Case, CheckFailure, CheckResult, not_implemented_message, run_checks

# ------------------------------------------------------------------ wrong answers, by name


def _fields(rows: torch.Tensor, in_features: int, block_size: int, scale_type=torch.float16):
    blocks = rows.reshape(rows.shape[0], in_features // block_size, 4 + block_size // 2)
    d = blocks[..., 0:2].contiguous().view(scale_type).float()
    m = blocks[..., 2:4].contiguous().view(scale_type).float()
    qs = blocks[..., 4:]
    return d, m, qs


def _dequantize_variants(rows: torch.Tensor, in_features: int, block_size: int) -> dict[str, torch.Tensor]:
    """What the usual mistakes compute, by the cause a learner should look at."""
    d, m, qs = _fields(rows, in_features, block_size)
    low, high = (qs & 0x0F).float(), (qs >> 4).float()
    shape = rows.shape[0], in_features
    interleaved = torch.stack([low, high], dim=-1).flatten(-2)
    bd, bm, _ = _fields(rows, in_features, block_size, torch.bfloat16)
    q = torch.cat([low, high], dim=-1)
    return {
        "the nibbles are taken in the other order: byte 4+j holds q[j] in its LOW 4 bits and q[j+B/2] in its "
        "HIGH 4 bits (yours put the high nibble first)": (d * torch.cat([high, low], -1) + m).reshape(shape),
        "the nibbles are interleaved (q[2j], q[2j+1] from byte 4+j): byte 4+j holds q[j] and q[j+B/2], half a "
        "block apart": (d * interleaved + m).reshape(shape),
        "the block's minimum m is left out: every weight is d * q + m, and m (bytes 2-3) is usually negative":
            (d * q).reshape(shape),
        "d and m are read as bfloat16: bytes 0-1 and 2-3 are IEEE half precision (torch.float16), whose 5 "
        "exponent bits and 10 mantissa bits are not bfloat16's 8 and 7": (bd * q + bm).reshape(shape),
        "d and m are swapped: bytes 0-1 are the step d, bytes 2-3 the minimum m": (m * q + d).reshape(shape),
        "the scale is applied after the minimum, (q + m) * d: the minimum is added to d * q, not to q":
            (d * (q + m)).reshape(shape),
    }


def _name_dequantize_mistake(got: torch.Tensor, rows: torch.Tensor, in_features: int, block_size: int):
    for cause, wrong in _dequantize_variants(rows, in_features, block_size).items():
        if got.shape == wrong.shape and torch.allclose(got.float(), wrong, rtol=1e-6, atol=1e-6, equal_nan=True):
            return cause
    return None


def _name_quantize_mistake(got: torch.Tensor, weight: torch.Tensor, block_size: int):
    """Decode your bytes field by field and say which field is off, and why it may be."""
    from microvllm.layers.quantization.gguf import quantize_q4_1

    want = quantize_q4_1(weight, block_size)
    if got.shape != want.shape or got.dtype != torch.uint8:
        return (f"the result must be uint8 {list(want.shape)} (per block: 2 bytes d, 2 bytes m, {block_size // 2} "
                f"bytes of nibbles); yours is {got.dtype} {list(got.shape)}")
    rows, in_features = weight.shape
    blocks = weight.float().reshape(rows, in_features // block_size, block_size)
    gd, gm, gqs = _fields(got, in_features, block_size)
    wd, wm, wqs = _fields(want, in_features, block_size)
    high, low = blocks.amax(-1, keepdim=True), blocks.amin(-1, keepdim=True)
    if not torch.equal(gd, wd):
        if torch.equal(gd, (high / 15).half().float()):
            return ("d is max / 15, the scale from the maximum alone: the 16 levels must run from the block's "
                    "minimum to its maximum, so what is the step between two levels?")
        if torch.equal(got.reshape(wqs.shape[:2] + (-1,))[..., 0:2].contiguous().view(torch.bfloat16).float(),
                       (high - low).div(15).bfloat16().float()):
            return "d and m are stored as bfloat16: a GGUF file stores them as IEEE half precision (torch.float16)"
        return "d (bytes 0-1) differs: which two numbers of the block give the step between its 16 levels?"
    if not torch.equal(gm, wm):
        return "m (bytes 2-3) differs: it is the block's smallest weight, the level that q = 0 stands for"
    wq = torch.cat([wqs & 0x0F, wqs >> 4], -1)
    gq_swapped = torch.cat([gqs >> 4, gqs & 0x0F], -1)
    if torch.equal(gq_swapped, wq):
        return ("the nibbles are in the other order: q[j] goes in the LOW 4 bits of byte 4+j, q[j+B/2] in its "
                "HIGH 4 bits")
    gq = torch.cat([gqs & 0x0F, gqs >> 4], -1)
    if torch.equal(torch.stack([gqs & 0x0F, gqs >> 4], -1).flatten(-2), wq):
        return "the nibbles are packed pairwise (q[2j], q[2j+1]): byte 4+j holds q[j] and q[j+B/2]"
    diff = gq.int() - wq.int()
    if diff.abs().max() == 1 and (diff <= 0).all():
        return ("some q are one level too low: is (w - m) / d truncated instead of rounded to the nearest level "
                "(llama.cpp adds 0.5 and truncates)?")
    if diff.abs().max() == 1:
        return ("some q are one level off: round (w - m) / d to the nearest level, halves up (add 0.5, then "
                "truncate), computing with 1 / d in float32 as llama.cpp does")
    return "the nibbles (bytes 4 on) differ: q = round((w - m) / d), clamped to 0..15"


# ------------------------------------------------------------------------ cases


def _file_rows(count: int = 4):
    """``(raw uint8 rows, in_features)`` of the embedded file's first Q4_1 matrix."""
    from microvllm.models.default_model import find_gguf
    from microvllm.models.gguf_file import GGUFIndex

    index = GGUFIndex(find_gguf())
    tensor = next(t for t in index.tensors if t.type_name == "Q4_1")
    return torch.from_numpy(np.array(tensor.data[:count])), tensor.shape[0], tensor.name


def _random_blocks(rows: int, in_features: int, block_size: int, seed: int) -> torch.Tensor:
    """Random bytes whose d and m are finite fp16 numbers of a weight's size."""
    g = torch.Generator().manual_seed(seed)
    nb = in_features // block_size
    d = (torch.rand(rows, nb, 1, generator=g) * 0.2).half().view(torch.uint8)
    m = (-torch.rand(rows, nb, 1, generator=g)).half().view(torch.uint8)
    qs = torch.randint(0, 256, (rows, nb, block_size // 2), generator=g, dtype=torch.uint8)
    return torch.cat([d, m, qs], -1).reshape(rows, -1)


def compare_dequantize(dequantize, rows: torch.Tensor, in_features: int, block_size: int, where: str) -> None:
    from microvllm.layers.quantization.gguf import dequantize_q4_1

    want = dequantize_q4_1(rows, in_features, block_size)
    got = dequantize(rows.clone(), in_features, block_size)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        raise CheckFailure(f"{where}: dequantize_q4_1 must return float32 [{rows.shape[0]}, {in_features}]",
                           got=getattr(got, "shape", got))
    if torch.equal(got.float(), want):
        return
    bad = (got.float() != want).nonzero()[0].tolist()
    block = bad[1] // block_size
    cause = _name_dequantize_mistake(got, rows, in_features, block_size)
    raw = rows[bad[0], block * (4 + block_size // 2):][:4 + block_size // 2]
    raise CheckFailure(
        f"{where}: row {bad[0]}, weight {bad[1]} (block {block}, index {bad[1] % block_size} in it) differs",
        input="block bytes " + " ".join(f"{b:02x}" for b in raw.tolist()[:12]) + " ...",
        expected=f"{want[bad[0], bad[1]].item():.6g}", got=f"{got[bad[0], bad[1]].item():.6g}",
        hint=cause or "decode one block by hand (the picture in the contract) and compare it with yours, field "
                           "by field")


def compare_quantize(quantize, weight: torch.Tensor, block_size: int, where: str, want: torch.Tensor | None = None):
    from microvllm.layers.quantization.gguf import quantize_q4_1

    want = quantize_q4_1(weight, block_size) if want is None else want
    got = quantize(weight.clone(), block_size)
    if isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want):
        return
    if not isinstance(got, torch.Tensor):
        raise CheckFailure(f"{where}: quantize_q4_1 must return a uint8 tensor", got=type(got).__name__)
    cause = _name_quantize_mistake(got, weight, block_size)
    shown = ""
    if got.shape == want.shape:
        row, byte = (got != want).nonzero()[0].tolist()
        per = 4 + block_size // 2
        start = byte // per * per
        shown = (f" (row {row}, block {byte // per}, byte {byte - start})",
                 " ".join(f"{b:02x}" for b in want[row, start:start + 12].tolist()) + " ...",
                 " ".join(f"{b:02x}" for b in got[row, start:start + 12].tolist()) + " ...")
    raise CheckFailure(f"{where}: your bytes differ" + (shown[0] if shown else ""),
                       expected=shown[1] if shown else list(want.shape), got=shown[2] if shown else list(got.shape),
                       hint=cause)


def check_q4_1(dequantize_q4_1, quantize_q4_1, *, quiet: bool = False) -> CheckResult:
    """Check your ``dequantize_q4_1(rows, in_features, block_size)`` and
    ``quantize_q4_1(weight, block_size)``; print and return the result."""

    def the_file():
        rows, in_features, name = _file_rows()
        compare_dequantize(dequantize_q4_1, rows[:1, :20], 32, 32, f"{name}, row 0, block 0 (notebook 16's)")
        compare_dequantize(dequantize_q4_1, rows, in_features, 32, f"{name}, rows 0-3")

    def random_blocks():
        for block_size, seed in ((32, 0), (64, 1), (128, 2)):
            compare_dequantize(dequantize_q4_1, _random_blocks(3, 256, block_size, seed), 256, block_size,
                               f"3 rows of random blocks, block_size={block_size}")

    def by_hand():
        ramp = torch.arange(32.0).reshape(1, 32) % 16 * 0.5 - 1.0   # levels -1.0 .. 6.5, step 0.5
        compare_quantize(quantize_q4_1, ramp, 32, "w = -1.0, -0.5, ..., 6.5 twice (d = 0.5, m = -1, q = 0..15)")
        flat = torch.full((1, 32), 0.25)
        compare_quantize(quantize_q4_1, flat, 32, "a block of 32 equal weights (d = 0: every q is 0, m is the weight)")

    def file_round_trip():
        from microvllm.layers.quantization.gguf import dequantize_q4_1 as package_dequantize

        rows, in_features, name = _file_rows()
        weights = package_dequantize(rows, in_features)
        compare_quantize(quantize_q4_1, weights, 32, f"{name} rows 0-3, dequantized, quantized again "
                         "(must give back the file's bytes)", want=rows)

    def like_llama_cpp():
        import gguf

        g = torch.Generator().manual_seed(3)
        weight = torch.randn(8, 256, generator=g) * 0.05
        weight[0, :32] = 0.125                               # one block of equal weights
        want = torch.from_numpy(gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_1))
        compare_quantize(quantize_q4_1, weight, 32, "random weights, against llama.cpp's quantizer "
                         "(gguf.quants.quantize)", want=want)
        compare_quantize(quantize_q4_1, torch.randn(4, 384, generator=g), 128, "random weights, block_size=128")

    cases = [
        Case("dequantize the embedded file's blocks (float32 equal to the package's)", the_file),
        Case("dequantize random blocks at block sizes 32, 64 and 128", random_blocks),
        Case("quantize a block by hand: a ramp of 16 levels, and a block of equal weights", by_hand),
        Case("quantize the file's weights back: the same bytes as the file", file_round_trip),
        Case("quantize random weights: byte for byte llama.cpp's round to nearest", like_llama_cpp),
    ]
    return run_checks("Q4_1 blocks", cases, quiet=quiet)


# --------------------------------------------------------------------- the engine

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Rain forms when")


def run_gguf_with(dequantize_q4_1, *, max_tokens: int = 4, quiet: bool = False):
    """Run the embedded GGUF model with ``enforce_eager=True`` (each ``Linear`` dequantizes
    its Q4_1 weight in torch before ``F.linear``), once with the package's dequantization and
    once with yours, greedy; compare the tokens. Returns an ``EngineRunResult``."""
    import microvllm.layers.quantization.gguf as gguf_format
    from microvllm import LLM, SamplingParams
    from microvllm.checks.engine_run import EngineRunResult
    from microvllm.models.default_model import find_gguf

    try:   # one block first: a part not written yet is said in one line, before a minute of engine
        dequantize_q4_1(_random_blocks(1, 32, 32, 0), 32)
    except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
        todo = not_implemented_message(exc)
        message = (f"run_gguf_with: not implemented yet ({todo})" if todo is not None else
                   f"your dequantize_q4_1 fails on one block: {type(exc).__name__}: {exc} (run check_q4_1 above)")
        if not quiet:
            print(message)
        return EngineRunResult(False, [], [], message)
    llm = LLM(model=str(find_gguf()), enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reference = [list(o.outputs[0].token_ids) for o in llm.generate(list(PROMPTS), params, use_tqdm=False)]
    package = gguf_format.DEQUANTIZE["Q4_1"]
    gguf_format.DEQUANTIZE["Q4_1"] = dequantize_q4_1
    try:
        yours = [list(o.outputs[0].token_ids) for o in llm.generate(list(PROMPTS), params, use_tqdm=False)]
    except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
        message = f"The engine stopped inside your dequantize_q4_1: {type(exc).__name__}: {exc}"
        if not quiet:
            print(message)
        return EngineRunResult(False, reference, [], message)
    finally:
        gguf_format.DEQUANTIZE["Q4_1"] = package
    lines = [f"The embedded GGUF model (Q4_1 projections), enforce_eager=True, with your dequantize_q4_1: "
             f"{len(PROMPTS)} prompts x {max_tokens} greedy tokens"]
    for prompt, ref, got in zip(PROMPTS, reference, yours):
        lines.append(f"  {prompt!r}: {'✓' if ref == got else '✗'} {got}")
        if ref != got:
            lines.append(f"      reference: {ref}")
    same = reference == yours
    lines.append("Same tokens as the package's dequantization." if same else
                 "Your tokens differ: run check_q4_1 above, which names the first weight that differs.")
    message = "\n".join(lines)
    if not quiet:
        print(message)
    return EngineRunResult(same, reference, yours, message)
