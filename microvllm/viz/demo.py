"""Small recorded traces for tests and for notebooks before the engine exists.

    demo_trace("prefix")          shared system prompt: shared blocks, cached-free blocks, hits
    demo_trace("preemption")      a pool too small for everyone: preemption, recompute, hits
    demo_trace("sliding_window")  window of 8 tokens: old blocks become the null block
    demo_trace("chunked")         long prompts under a small budget: mixed prefill + decode steps
    large_demo_trace()            hundreds of steps and blocks, for timing the explorer

Every trace comes from `DemoEngine`, a toy scheduler with a real block allocator,
and passes `Trace.check_consistency()`.
"""

from __future__ import annotations

import random

from microvllm.trace import Trace
from microvllm.viz.demo_engine import DemoEngine, DemoRequest

KINDS = ("prefix", "preemption", "sliding_window", "chunked")

SYSTEM = "You are a helpful assistant . Answer in one short sentence ."
QUESTIONS = [
    "What is a KV cache ?",
    "Why do we page the KV cache into blocks ?",
    "How does a prefix cache find a hit ?",
    "What is continuous batching ?",
    "Why is the last prompt token always recomputed ?",
    "What happens to a preempted request ?",
]


class _Vocab:
    """Words -> token ids, so equal text gives equal ids (and equal block hashes)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.ids.setdefault(word, 1000 + len(self.ids)) for word in text.split()]


def _requests(specs, vocab: _Vocab):
    """specs: (request_id, text, max_tokens, arrival_step[, finish_reason])."""
    requests, prompts = [], {}
    for rid, text, max_tokens, arrival, *reason in specs:
        requests.append(DemoRequest(rid, vocab.encode(text), max_tokens, arrival, *reason))
        prompts[rid] = text
    return requests, prompts


def demo_trace(kind: str = "prefix", *, hybrid: bool = False, seed: int = 0) -> Trace:
    """A small, internally consistent trace showing one idea (see module docstring).

    ``hybrid=True`` (sliding_window only) gives two cache groups, full attention
    plus sliding window, like models that interleave both kinds of layer.
    """
    vocab = _Vocab()
    if kind == "prefix":
        specs = [("r0", f"{SYSTEM} {QUESTIONS[0]}", 6, 0),
                 ("r1", f"{SYSTEM} {QUESTIONS[1]}", 5, 2, "stop"),
                 ("r2", "Translate to French : the cat sleeps", 4, 3),
                 ("r3", f"{SYSTEM} {QUESTIONS[2]}", 5, 11)]
        settings = dict(block_size=4, num_blocks=24, max_num_batched_tokens=32, max_num_seqs=4)
    elif kind == "preemption":
        specs = [(f"r{i}", f"{SYSTEM} {QUESTIONS[i]}", 14, i // 2) for i in range(4)]
        settings = dict(block_size=4, num_blocks=16, max_num_batched_tokens=32, max_num_seqs=4)
    elif kind == "sliding_window":
        specs = [("r0", QUESTIONS[0], 18, 0), ("r1", QUESTIONS[3], 14, 1), ("r2", QUESTIONS[4], 8, 3)]
        groups = ("full_attention", "sliding_window") if hybrid else ("sliding_window",)
        settings = dict(block_size=4, num_blocks=32 if hybrid else 20, max_num_batched_tokens=32,
                        max_num_seqs=4, kv_cache_groups=groups, sliding_window=8)
    elif kind == "chunked":
        long_text = f"{SYSTEM} {QUESTIONS[1]} {QUESTIONS[4]}"
        specs = [("r0", QUESTIONS[3], 8, 0), ("r1", long_text, 4, 1), ("r2", QUESTIONS[5], 4, 2)]
        settings = dict(block_size=4, num_blocks=32, max_num_batched_tokens=10, max_num_seqs=4)
    else:
        raise ValueError(f"unknown demo trace kind {kind!r}: choose one of {KINDS}")
    if hybrid and kind != "sliding_window":
        raise ValueError("hybrid=True only applies to demo_trace('sliding_window')")
    requests, prompts = _requests(specs, vocab)
    return DemoEngine(requests, prompts=prompts, seed=seed, **settings).run()


def large_demo_trace(num_requests: int = 100, num_blocks: int = 256, *, block_size: int = 8,
                     max_num_batched_tokens: int = 128, max_num_seqs: int = 32, arrival_every: int = 2,
                     seed: int = 0) -> Trace:
    """Hundreds of steps over a pool of hundreds of blocks: random prompts sharing prefixes."""
    rng = random.Random(seed)
    vocab = _Vocab()
    specs = []
    for i in range(num_requests):
        text = f"{SYSTEM} {rng.choice(QUESTIONS)} " + " ".join(
            f"w{rng.randrange(500)}" for _ in range(rng.randrange(4, 60)))
        specs.append((f"r{i}", text, rng.randrange(16, 96), i * arrival_every))
    requests, prompts = _requests(specs, vocab)
    return DemoEngine(requests, prompts=prompts, seed=seed, block_size=block_size, num_blocks=num_blocks,
                      max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs).run()
