"""The workloads ``run_engine_with`` runs: for each component, prompts, sampling parameters and
engine settings chosen so that a wrong component changes the tokens or a step's decisions.

    SCHEDULER_RUN  8 prompts (3-22 tokens, four short); max_num_seqs=4, max_num_batched_tokens=16,
                   num_kv_blocks=7 (6 usable blocks of 16 tokens). The reference engine:
                     step 0      request 0 gets the whole budget (a 16-token chunk)
                     step 1      request 0's last 6 tokens, request 1 after a 16-token prefix hit,
                                 request 2's first chunk
                     step 4      a running request needs a block and none is free: request 3, the
                                 most recently admitted, is preempted, and nothing is admitted in
                                 that step although its freed blocks would take a waiting chunk
                     step 16     four seats taken while requests wait (max_num_seqs binds)
    PREFIX_RUN     5 prompts, three sharing a 16-token prefix; num_kv_blocks=6, budget 32: a hit on a
                   block in use (step 0), preemption, and a hit on a freed block still cached (the
                   fifth prompt): the LRU order decides which blocks are evicted
    PREFIX_HASH_RUN  7 prompts in blocks of 8; num_kv_blocks=16, budget 32, 4 seats (exercise 04, with
                   the learner's hash): prompts 0 and 1 share 16 tokens (a hit in step 0); X = A+C, Y = D+B,
                   then P = A+B, whose second block holds the same tokens as Y's after another parent (a
                   hash that ignores the parent hits it); X again with prompt_logprobs (its own cache
                   salt: a hash that ignores extra keys hits it); a request preempted after it generated
                   a block's worth of tokens resumes with a hit over prompt and output
    SAMPLED_RUN    one greedy prompt and five seeded ones, each with its own filter (top-k, top-p,
                   min-p, none, all three), then one prompt per filter with n=16 seeded samples at
                   temperature 1 (192 draws each): a bug in one filter changes that prompt's tokens;
                   enforce_eager=True, so that the draw is the learner's random_sample (a platform may
                   swap in its own, platforms/cpu/sampling.py)
    MODEL_RUNNER_RUN  the greedy prompt and the five seeded ones of SAMPLED_RUN in blocks of 8, a budget of
                   8 tokens and 7 usable blocks: mixed steps, and requests preempted and resumed, whose
                   prompt + output tokens are recomputed in chunks (the rule for which rows sample)
    DETOKENIZER_RUN  the 4 prompts and one more: stop strings that straddle tokens and end just before
                   min_tokens, seeded prompts whose output splits characters over tokens; the text is
                   compared after every step, not only at the end
    STRUCTURED_RUN five prompts, each under a regex (structured_outputs_backend="course"), greedy and
                   seeded: a token mask that lets one wrong token through, or forbids a right one,
                   changes what the random model writes (token_trie)
    SPEC_DECODE_RUN  6 prompts that repeat themselves, n-gram drafts (3 a step): greedy and seeded at
                   several temperatures, so that steps keep every draft (a bonus token), reject one
                   (a token from the residual) or have no drafts (rejection_sampler)
    GREEDY_RUN     the 4 prompts, greedy: everything else (decode kernel)
"""

from __future__ import annotations

from dataclasses import dataclass

from microvllm.sampling_params import StructuredOutputsParams

# Prompts that share a prefix (prefix-cache hits), of mixed lengths (chunking), one with
# characters the tiny tokenizer splits into byte tokens (detokenization).
PROMPTS = [
    "The scheduler decides which requests run in each step; the model runner",
    "The scheduler decides which requests run in each step, and the sampler",
    "Héllo wörld 🙂, the capital of France is",
    {"prompt_token_ids": [5, 17, 42, 99, 3, 250, 11, 7, 64, 128, 33, 2, 90, 45, 6, 301, 12, 8, 77]},
]
GREEDY = {"temperature": 0.0}


@dataclass(frozen=True)
class Workload:
    """What one engine run does: prompts, one SamplingParams (as keyword arguments) per prompt,
    engine settings, and whether every step's decisions are compared (``steps``, ``blocks``)."""

    name: str
    prompts: tuple
    params: tuple[dict, ...]
    settings: tuple[tuple[str, object], ...] = ()
    steps: bool = False
    blocks: bool = False


GREEDY_RUN = Workload("greedy", tuple(PROMPTS), (GREEDY,) * 4)
SCHEDULER_RUN = Workload(
    "scheduler", tuple(PROMPTS) + ("A short one", {"prompt_token_ids": [7, 8, 9, 10, 11]},
                                   {"prompt_token_ids": [40, 41, 42]}, "Two more"), (GREEDY,) * 8,
    (("num_kv_blocks", 7), ("max_num_batched_tokens", 16), ("max_num_seqs", 4)), steps=True)
PREFIX_RUN = Workload(
    "prefix cache", tuple(PROMPTS) + ("The scheduler decides which requests run in each step; the block pool",),
    (GREEDY,) * 5, (("num_kv_blocks", 6), ("max_num_batched_tokens", 32)), steps=True, blocks=True)
_A, _B, _C, _D = (list(range(start, start + 8)) for start in (100, 200, 300, 400))   # one block each
PREFIX_HASH_RUN = Workload(
    "prefix cache and hash",
    (PROMPTS[0], PROMPTS[1], {"prompt_token_ids": _A + _C + [1, 2, 3]}, {"prompt_token_ids": _D + _B + [4, 5]},
     PROMPTS[2], {"prompt_token_ids": _A + _B + [6, 7, 8]}, {"prompt_token_ids": _A + _C + [1, 2, 3]}),
    (GREEDY,) * 6 + ({"temperature": 0.0, "prompt_logprobs": 1},),
    (("block_size", 8), ("num_kv_blocks", 16), ("max_num_batched_tokens", 32), ("max_num_seqs", 4)),
    steps=True, blocks=True)
SAMPLED_PARAMS = (GREEDY, dict(temperature=0.8, top_k=3, seed=11), dict(temperature=0.3, top_p=0.6, seed=12),
                  dict(temperature=0.5, min_p=0.5, seed=13), dict(temperature=1.0, seed=14),
                  dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.1, seed=15))
# Many seeded draws per filter, at temperature 1 where each filter cuts off much of the mass: a
# sampler that ignores a filter (or applies it slightly wrong) draws other tokens in some of them.
MANY_DRAWS = (dict(temperature=1.0, top_k=5, seed=21, n=16), dict(temperature=1.0, top_p=0.5, seed=22, n=16),
              dict(temperature=1.0, min_p=0.2, seed=23, n=16))
SAMPLED_RUN = Workload("sampled", tuple(PROMPTS) + ("A short one", "Seeds make sampling repeatable",
                                                    "Top-k keeps", "Top-p keeps", "Min-p keeps"),
                       SAMPLED_PARAMS + MANY_DRAWS, (("max_num_batched_tokens", 32), ("enforce_eager", True)))
# Requests resumed after preemption recompute prompt + output tokens in chunks of at most 8: a runner
# that decides which rows sample by the prompt's length samples mid-chunk (or not at the end).
MODEL_RUNNER_RUN = Workload("model runner", tuple(PROMPTS) + ("A short one", "Seeds make sampling repeatable"),
                            SAMPLED_PARAMS, (("block_size", 8), ("num_kv_blocks", 8), ("max_num_batched_tokens", 8)))
# The tiny model's own output (checked by tests/course/test_engine_run.py, which fails if it drifts):
# greedy prompt 0 writes "\x1c" "it" "er" "(" ...: the stop string "ter(" straddles three tokens;
# greedy prompt 1 writes "The" " plan" ...: with min_tokens=2 the search starts after " plan", so the
# stop string "plan", which ends exactly there, must not count (so this prompt runs on, and a search
# one character too early fails it); the seeded prompts 2 and 4 write
# characters split over two tokens ("ֱ", "܄") and genuinely invalid bytes between them.
DETOKENIZER_RUN = Workload(
    "detokenizer", tuple(PROMPTS) + (PROMPTS[0],),
    ({"temperature": 0.0, "stop": ["ter("]}, {"temperature": 0.0, "min_tokens": 2, "stop": ["plan"]},
     {"temperature": 1.0, "seed": 2}, GREEDY, {"temperature": 1.0, "seed": 1}),
    (("enforce_eager", True),))   # the seeded prompts' tokens are the plain draw's (see SAMPLED_RUN)
STRUCTURED_PATTERNS = (r"[0-9]{3}-[0-9]{4}", r'\{"name": "[a-z]{1,8}", "age": [0-9]{1,2}\}', r"(yes|no|maybe)",
                       r"[A-Z][a-z]+( [a-z]+){1,4}\.", r"(0|[1-9][0-9]*)\.[0-9]{2} (EUR|USD)")
STRUCTURED_RUN = Workload(
    "structured", tuple(PROMPTS) + ("A short one",),
    tuple(dict(temperature=0.0 if i % 2 == 0 else 1.0, **({} if i % 2 == 0 else {"seed": 20 + i}),
               structured_outputs=StructuredOutputsParams(regex=pattern))
          for i, pattern in enumerate(STRUCTURED_PATTERNS)),
    (("structured_outputs_backend", "course"),))
# Prompts that repeat themselves, so that n-gram drafts (3 a step) exist and are often right. Measured
# on the reference engine: the greedy prompt and the seeded ones at temperature 0.2 and 0.3 have steps
# where every draft is kept (a bonus token) and steps with a rejection; the top-k prompt rejects all 25
# of its drafts (a token from the residual each time); prompts 2 and 3 get no drafts (K = 0 rows).
SPEC_DECODE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SPEC_DECODE_RUN = Workload(
    "speculative decoding",
    ("one two three four one two three four one two three four one two", {"prompt_token_ids": [5, 6, 7, 8, 9] * 5},
     PROMPTS[0], "a b c a b c a b c a b", {"prompt_token_ids": [29, 487, 307] * 6},
     {"prompt_token_ids": [424, 187] * 8}),
    (GREEDY, dict(temperature=0.2, seed=30), dict(temperature=0.5, seed=31), dict(temperature=1.0, seed=32),
     dict(temperature=0.7, top_k=5, seed=33), dict(temperature=0.3, top_p=0.9, seed=34)),
    (("speculative_config", SPEC_DECODE),))
WORKLOADS = {"detokenizer": DETOKENIZER_RUN, "scheduler": SCHEDULER_RUN, "block_pool": PREFIX_RUN,
             "kv_cache_manager": PREFIX_HASH_RUN, "sampler": SAMPLED_RUN, "model_runner": MODEL_RUNNER_RUN,
             "block_table": MODEL_RUNNER_RUN, "token_trie": STRUCTURED_RUN,
             "rejection_sampler": SPEC_DECODE_RUN}


def params_text(params: dict) -> str:
    structured = params.get("structured_outputs")
    regex = f"regex {structured.regex!r}, " if structured is not None else ""
    if params.get("temperature", 1.0) == 0.0:
        return regex + ", ".join(["greedy"] + [f"{k}={v}" for k, v in params.items()
                                               if k not in ("temperature", "structured_outputs")])
    return regex + ", ".join(f"{k}={v}" for k, v in params.items() if k != "structured_outputs")


FILTER_HINTS = {
    "top_k": "apply_top_k keeps each row's top_k[row] largest logits (ties with the k-th too)",
    "top_p": "apply_top_p keeps a token while the mass ranked above it is < top_p (so the token that "
             "crosses top_p stays)",
    "min_p": "Sampler.sample applies min-p (apply_min_p) after top-k and top-p when metadata.min_p is set",
}


def sampling_hint(params: tuple[dict, ...], wrong: list[bool]) -> str:
    """Which part of the sampler to look at, from which prompts' tokens differ."""
    if not any(wrong):
        return "the tokens are the same but the text differs: look at the detokenizer"
    if any(bad and p == GREEDY for p, bad in zip(params, wrong)):
        return "greedy rows must take logits.argmax(dim=-1), exactly"
    sampled = [(set(p) - {"temperature", "seed", "n"}, bad, p.get("n", 1) > 1)
               for p, bad in zip(params, wrong) if p != GREEDY]
    if all(bad for _, bad, _ in sampled):
        return ("every sampled prompt differs: divide by the temperature, then draw each seeded row's noise "
                "from its own generator (generators[row]), the others from self.generator")
    suspects = set.intersection(*[keys for keys, bad, _ in sampled if bad])
    # A filter is proven right only by many draws that all matched (a few tokens prove little).
    suspects -= set().union(*[keys for keys, bad, many in sampled if not bad and many and len(keys) == 1])
    if suspects:
        return "; ".join(FILTER_HINTS[name] for name in sorted(suspects) if name in FILTER_HINTS)
    return ("the prompts that differ share no filter that the others lack: check how temperature "
            "reshapes the logits (logits / temperature) and the order temperature, top-k, top-p, min-p")
