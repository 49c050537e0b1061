"""Exercise 07a: the sampler."""

from microvllm.course.exercise import Exercise, Part
from microvllm.sample.sampler import Sampler
from microvllm.sample.topk_topp_sampler import apply_top_k, apply_top_p, random_sample

EXERCISE = Exercise(
    number="07", slug="sampler", title="The sampler: temperature, top-k, top-p, seeds",
    lecture="07 · the model runner and the sampler",
    intro="""You write how one step's logits become one next token per request: greedy rows
take the argmax, random rows are divided by their temperature, filtered by top-k and top-p, and
drawn — seeded requests from their own generator, so their tokens do not depend on the batch.""",
    setup="""
import torch
from torch import nn

from microvllm.sample.logits_processors import apply_allowed_token_ids, apply_logit_bias
from microvllm.sample.logprobs import compute_logprobs, gather_logprobs
from microvllm.sample.metadata import SamplingMetadata, make_generator
from microvllm.sample.penalties import apply_min_tokens_penalty, apply_penalties
from microvllm.sample.sampler import Argmax, RandomSample, SamplerOutput
from microvllm.sample.topk_topp_sampler import apply_min_p
from microvllm.sampling_params import SAMPLING_EPS
from microvllm.checks import check_sampler, run_engine_with
""",
    parts=(Part(apply_top_k), Part(apply_top_p), Part(random_sample),
           Part(Sampler, intro="""`forward` (given) takes the raw logprobs and applies `min_tokens`, `logit_bias`,
`allowed_token_ids` and bad words;
you write `sample`, which calls *your* three functions above.""")),
    todos={
        "apply_top_k": "keep each row's top_k[row] largest logits (0 = all; ties with the k-th kept), "
                       "set the rest to -inf",
        "apply_top_p": "sort each row, keep tokens whose probability mass ranked above them is < top_p[row], "
                       "set the rest to -inf",
        "random_sample": "draw one token per row with the exponential race: argmax(probs / E), "
                         "E ~ Exponential(1) from the row's own generator if it has one",
        "Sampler.sample": "argmax for greedy rows; divide the others by their temperature, apply "
                          "top-k, top-p, min-p, softmax, self.random_sample; pick per row",
    },
    contract="""
Every function works on the whole batch at once (`logits: [num_reqs, vocab]`, one parameter
value per row) and never modifies its input:

- `apply_top_k(logits, top_k)`: keep the `top_k[row]` largest logits of each row (`0` = keep all;
  larger than the vocabulary = keep all; values tied with the k-th are kept); others become `-inf`.
- `apply_top_p(logits, top_p)`: sorted from most to least likely, a token stays if the
  probability of the tokens ranked above it is `< top_p[row]` — so the top token always stays, and
  the token that crosses `top_p` stays too; `top_p = 1` keeps everything.
- `random_sample(probs, generators, shared_generator)`: one token per row by the exponential race
  `argmax(probs / E)`, `E ~ Exponential(1)`: row `r` in `generators` fills its noise from
  `generators[r]`, every other row from `shared_generator` (one call for the whole batch).
- `Sampler.sample(logits, metadata)`: rows with `temperature < SAMPLING_EPS` are greedy
  (`self.argmax(logits)`: `logits.argmax(-1)` exactly, as Hugging Face); the others are divided by their temperature,
  filtered by top-k, top-p, then min-p (each only if its tensor in `metadata` is not None),
  softmaxed and drawn with `self.random_sample(probs, metadata.generators, self.generator)` (the op
  `__init__` builds around your `random_sample`: it runs your function; a platform may swap in a
  faster draw, so the engine cell below runs with `enforce_eager=True`); use
  `metadata.all_greedy` / `all_random` to skip work.
""",
    hints=(
        """Top-k: `logits.topk(int(k.max()), dim=-1).values` gives each row's largest values; gather
the k-th one per row as a threshold and `masked_fill(logits < threshold, -inf)`.""",
        """Top-p: `sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)`; with
`p = sorted_logits.softmax(-1)`, the mass above each token is `p.cumsum(-1) - p`. Scatter the
keep-mask back with `torch.empty_like(keep).scatter_(-1, sorted_ids, keep)`.

`random_sample`: one `exponential_` call on the whole noise tensor with `shared_generator` (skip it
when every row has its own generator: the shared generator must advance exactly as the engine's),
then refill each seeded row from its own generator; a noise of exactly 0 must not divide anything.""",
        """Before you run this, predict the filtered rows: which of the two 2.0 logits does top-k 2 keep
(both: ties with the k-th stay)? Does top-p 0.7 keep token 2, whose mass above it is 0.64? Then: a
row drawn with its own generator must give the same token alone and as row 1 of a batch.
```python
# Test case: paste it into a new cell and run it (it uses your functions above)
NEG = float("-inf")
logits = torch.tensor([[3.0, 1.0, 2.0, 2.0], [0.0, 1.0, 2.0, 3.0]])
assert apply_top_k(logits, torch.tensor([2, 0])).tolist() == [[3.0, NEG, 2.0, 2.0], [0.0, 1.0, 2.0, 3.0]]
# row 1's probabilities are about [0.03, 0.09, 0.24, 0.64]
assert apply_top_p(logits, torch.tensor([1.0, 0.7])).tolist()[1] == [NEG, NEG, 2.0, 3.0]
assert apply_top_p(logits, torch.tensor([1.0, 0.5])).tolist()[1] == [NEG, NEG, NEG, 3.0]
probs = torch.full((2, 6), 1 / 6)
alone = random_sample(probs[:1], {0: torch.Generator().manual_seed(7)}, torch.Generator().manual_seed(0))
second = random_sample(probs, {1: torch.Generator().manual_seed(7)}, torch.Generator().manual_seed(0))
assert alone.tolist() == [1], alone
assert second.tolist() == [2, 1], second   # row 1: the same token as alone
```""",
    ),
    checks=("check_sampler(Sampler)",),
    engine_intro="""`components={"sampler": Sampler}` makes the model runner sample every token with
your class. One prompt is greedy (the argmax must be exact); the others sample with temperature,
top-k, top-p and min-p, each from its own seed. A seeded request draws the same tokens from the same
logits, so every token must equal the reference engine's. The last three prompts test one filter
each on many draws (16 seeded samples at temperature 1, where the filter cuts off much of the mass):
a filter that is skipped, or kept one token too wide, changes some of them. When prompts differ,
the hint says which filter they have in common.""",
    engine='run_engine_with({"sampler": Sampler})',
)
