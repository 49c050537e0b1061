"""Exercise 16: a Q4_1 block from its bytes, and a block of weights into Q4_1."""

from microvllm.course.exercise import Exercise, Part
from microvllm.layers.quantization.gguf import dequantize_q4_1, quantize_q4_1

EXERCISE = Exercise(
    number="16", slug="q4_1_blocks", title="Quantized weights: a Q4_1 block, from its bytes and back",
    lecture="16 · quantized weights",
    intro="""You write the two functions that define llama.cpp's Q4_1 format, the one the embedded
GGUF file stores its projections in: `dequantize_q4_1` turns a row of stored blocks back into
float32 weights (what `LLM(model="<file>.gguf", enforce_eager=True)` runs before every `F.linear`),
and `quantize_q4_1` turns float weights into those bytes by round to nearest (what llama.cpp's
`quantize_row_q4_1_ref` does). Every weight of a block of B is one of 16 evenly spaced levels,
from the block's minimum `m` in steps of `d`.""",
    setup="""
import torch

from microvllm.layers.quantization.gguf import BLOCK
from microvllm.checks.quantization import check_q4_1, run_gguf_with
""",
    parts=(Part(dequantize_q4_1, intro="""One block of B = 32 weights is 20 bytes:

    byte   0-1     2-3     4         5         ...  19
           d fp16  m fp16  q0 | q16  q1 | q17  ...  q15 | q31      (low nibble | high nibble)
    w[i] = d * q[i] + m

`rows` is `uint8 [N, K / B * (4 + B / 2)]`: N rows of blocks, back to back, as the file holds them."""),
           Part(quantize_q4_1, intro="""The way back, for any float weights: per block, the 16 levels must
cover the block's smallest and largest weight; each weight is stored as the number of its nearest
level. llama.cpp rounds by adding 0.5 and truncating, with the reciprocal of d computed once."""),),
    todos={
        "dequantize_q4_1": "read d and m (bytes 0-1, 2-3) as float16, split bytes 4.. into their two 4-bit halves "
                           "in the stored order, and set weights = d * q + m, shaped [N, blocks, B]",
        "quantize_q4_1": "per block: m = min, d = (max - min) / 15, q = trunc((w - m) * (1 / d) + 0.5) in 0..15 "
                         "(d = 0: q = 0); pack q[j] | q[j + B/2] << 4; set stored = d, m as float16 bytes, "
                         "then the packed bytes",
    },
    contract="""
`dequantize_q4_1(rows, in_features, block_size=32) -> float32 [N, in_features]`:

- a block of `B = block_size` weights is `4 + B / 2` bytes: `d` (bytes 0-1) and `m` (bytes 2-3), each an
  IEEE half-precision float (`torch.float16`, little-endian, as the file stores it), then `B / 2` bytes
  of 4-bit values;
- byte `4 + j` holds `q[j]` in its **low** 4 bits and `q[j + B / 2]` in its **high** 4 bits
  (llama.cpp's layout: the first half of the block in the low nibbles, the second in the high);
- `w[i] = d * q[i] + m`, computed in float32: your result must equal the package's exactly;
- no Python loop over blocks: one tensor operation over all of them (the engine calls this for
  every layer at every step).

`quantize_q4_1(weight, block_size=32) -> uint8 [N, in_features / B * (4 + B / 2)]`:

- per block: `m` = the smallest weight, `d = (max - min) / 15`, both stored as float16;
- `q = trunc((w - m) * (1 / d) + 0.5)`, clamped to 0..15, computed in float32 with the float32 `d`
  and `m` (before they are rounded to float16), as llama.cpp does; a block whose weights are all
  equal has `d = 0` and every `q = 0`;
- the result is byte for byte llama.cpp's (`gguf.quants.quantize`), and quantizing the dequantized
  blocks of the embedded file gives back the file's own bytes.
""",
    hints=(
        """Take the first block of notebook 16 (`55 30 d0 b8 02 07 65 31 ...`). Which bytes are `d`, which
are `m`? Byte 4 is `0x02`: which two q does it hold, and which of the two is `0x2`? Byte 5 is `0x07`:
which positions of the block are `q = 7` and `q = 0`?

    byte 4 = 0x02 = 0000 0010        high nibble -> q[?]     low nibble -> q[?]

How do you read two bytes as one float16 for a whole `[N, blocks, 2]` tensor at once (what does
`.view(torch.float16)` need from the last dimension)?""",
        """For quantizing, draw one block's weights on a line:

    min ●────●────●────●── ... ──●────● max      16 levels, 15 steps between them
        q=0  q=1  q=2               q=15

Which step `d` makes the last level land exactly on the largest weight? Where does a weight halfway
between two levels go, and what does `trunc(x + 0.5)` do with it? What happens to `1 / d` when
every weight of the block is the same?""",
        """Before you run this, decode by hand: what are d, m and the first four weights of this block?
```python
# Test case: paste it into a new cell and run it (it uses your functions above)
raw = torch.tensor([[0x00, 0x3c, 0x00, 0xbc] + [0xf0] + [0x32] * 15], dtype=torch.uint8)  # d = 1.0, m = -1.0
w = dequantize_q4_1(raw, 32)
assert w[0, :2].tolist() == [-1.0, 1.0] and w[0, 16:18].tolist() == [14.0, 2.0], w
assert torch.equal(quantize_q4_1(w), raw), quantize_q4_1(w)
```""",
    ),
    checks=("result = check_q4_1(dequantize_q4_1, quantize_q4_1)",),
    engine_intro="""`run_gguf_with(dequantize_q4_1)` loads the embedded GGUF file with
`enforce_eager=True`, where every Q4_1 projection (`GGUFLinearMethod`) dequantizes its weight in
torch before `F.linear`, and runs three prompts greedily twice: with the package's
`dequantize_q4_1` and with yours in its place. The tokens must be the same. It takes about a minute
on a 2-core CPU: each step expands about 100 million weights from their blocks.""",
    engine="run_gguf_with(dequantize_q4_1)",
)
