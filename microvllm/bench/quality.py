"""What quantized weights change in the output: greedy agreement, logit margins, perplexity.

    greedy_agreement(reference, candidate)   32 fixed prompts, greedy: which outputs are
        identical; where one is not, the first token where they part and the reference's
        logit margin there (its top-1 minus top-2 log-probability: a small margin is a near
        tie that any rounding may flip)
    perplexity(llm)                          exp(mean negative log-likelihood) of a few fixed
        paragraphs, from prompt_logprobs (the model reading them, not generating)
    weights_replaced(llm, roundtrip)         for a while, every projection's float weight W is
        roundtrip(W) (quantize then dequantize): a format's error, measured in float32 against
        the weights the engine loaded (an ``enforce_eager=True`` engine: its F.linear reads W)

Used by ``bench throughput --workload quantization`` and notebook 16.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The largest planet in the solar system is",
    "def fibonacci(n):", "Once upon a time, in a small village,", "The three primary colors are",
    "To make a cup of tea, first", "The theory of relativity was developed by", "A haiku about the ocean:",
    "The main ingredients of bread are", "In computer science, a hash table is", "The French word for cat is",
    "Photosynthesis is the process by which", "The first person to walk on the moon was",
    "import numpy as np\n", "The best way to learn a new language is", "Rain forms when",
    "A list of fruits: apple, banana,", "The Great Wall of China was built to", "Dear Sir or Madam,",
    "The square root of 144 is", "Shakespeare wrote the play", "An electric car works by",
    "The human heart has four chambers:", "SELECT name FROM users WHERE", "The recipe calls for two cups of",
    "Mount Everest is located in", "The speed of light is about", "My favourite season is autumn because",
    "A good night's sleep helps", "The Internet was originally designed to", "Q: What is 7 times 8?\nA:",
]

PARAGRAPHS = [
    "The city wakes up slowly on Sunday mornings. Bakeries open their doors first, and the smell of "
    "fresh bread drifts along the quiet streets. By nine o'clock the market square is full of people "
    "buying vegetables, flowers and cheese from the farmers who drove in before dawn.",
    "A computer program is a list of instructions that a machine can follow. Programmers write these "
    "instructions in a programming language, which is then translated into the simple operations the "
    "processor understands. Good programs are easy to read, test and change.",
    "Rivers shape the land they flow through. Over thousands of years, moving water carves valleys, "
    "carries soil to the sea and builds wide plains where people grow food. Many of the first cities "
    "were founded on the banks of great rivers.",
]


@dataclass
class Divergence:
    prompt: int
    position: int             # first output token where the two differ
    reference_margin: float   # reference's top-1 minus top-2 log-probability there
    candidate_margin: float


def _greedy(llm, prompts: list[str], max_tokens: int):
    from microvllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _margin(step_logprobs: dict) -> float:
    top = sorted((lp.logprob for lp in step_logprobs.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else math.inf


def greedy_agreement(reference, candidate, prompts: list[str] = PROMPTS,
                     max_tokens: int = 32) -> tuple[int, list[Divergence]]:
    """``(identical outputs, divergences)`` of ``candidate``'s greedy outputs against
    ``reference``'s (two ``LLM``s with the same tokenizer)."""
    ref, cand = _greedy(reference, prompts, max_tokens), _greedy(candidate, prompts, max_tokens)
    same, divergences = 0, []
    for i, (a, b) in enumerate(zip(ref, cand)):
        if list(a.token_ids) == list(b.token_ids):
            same += 1
            continue
        pos = next(j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        divergences.append(Divergence(i, pos, _margin(a.logprobs[pos]), _margin(b.logprobs[pos])))
    return same, divergences


def perplexity(llm, texts: list[str] = PARAGRAPHS) -> float:
    """exp(mean negative log-likelihood per token) of ``texts`` under ``llm``."""
    from microvllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    total, count = 0.0, 0
    for out in llm.generate(texts, params, use_tqdm=False):
        for token, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
            total -= position[token].logprob
            count += 1
    return math.exp(total / count)


def describe(name: str, same: int, divergences: list[Divergence], total: int) -> str:
    lines = [f"{name}: {same}/{total} greedy outputs identical to f32"]
    for d in divergences:
        lines.append(f"  prompt {d.prompt:2}: parts at output token {d.position}; f32's margin there "
                     f"{d.reference_margin:.3f}, {name}'s {d.candidate_margin:.3f} (log-probability, top-1 - top-2)")
    return "\n".join(lines)


@contextmanager
def weights_replaced(llm, roundtrip: Callable) -> Iterator[float]:
    """Inside the ``with``: every float ``Linear`` weight ``W`` of ``llm``'s model (the
    projections; the tied embedding / LM head stays as it is) holds ``roundtrip(W)``; after
    it, ``W`` again. Yields the weights' relative error, ``||roundtrip(W) - W|| / ||W||`` over
    all of them (root mean square of the change over that of the weights). ``llm`` must be an
    ``enforce_eager=True`` engine, whose ``F.linear`` reads the weight itself (the platform's
    GEMM reads a packed copy made once at load time)."""
    from microvllm.layers.linear import Linear
    from microvllm.layers.vocab_parallel_embedding import ParallelLMHead

    if not llm.engine.config.device_config.enforce_eager:
        raise ValueError("weights_replaced needs LLM(..., enforce_eager=True): the platform's GEMM reads a "
                         "packed copy of each weight that replacing the weight does not change")
    model = llm.engine.executor.worker.model
    layers = [m for m in model.modules()
              if isinstance(m, Linear) and not isinstance(m, ParallelLMHead) and m.quant_method is None]
    saved = [layer.weight.data.clone() for layer in layers]
    try:
        change = size = 0.0
        for layer, weight in zip(layers, saved):
            layer.weight.data.copy_(roundtrip(weight))
            change += (layer.weight.data - weight).double().square().sum().item()
            size += weight.double().square().sum().item()
        yield math.sqrt(change / size)
    finally:
        for layer, weight in zip(layers, saved):
            layer.weight.data.copy_(weight)
