"""The workloads ``run_engine_with`` runs: for each component, prompts, sampling parameters and
engine settings chosen so that a wrong component changes the tokens or a step's decisions.

    SCHEDULER_RUN  6 prompts (19-22 tokens, two short); max_num_seqs=3, max_num_batched_tokens=16,
                   num_kv_blocks=7 (6 usable blocks of 16 tokens). The reference engine:
                     step 0      request 0 gets the whole budget (a 16-token chunk)
                     step 1      requests 1 (after a 16-token prefix hit) and 2 join: 3 seats taken,
                                 3 more wait although blocks are free (max_num_seqs binds)
                     step 12     request 2 needs a block, none is free: it is preempted
                     step 13...  the preempted request comes back, the short ones join
    PREFIX_RUN     5 prompts, three sharing a 16-token prefix; num_kv_blocks=6, budget 32: a hit on a
                   block in use (step 0), preemption, and a hit on a freed block still cached (the
                   fifth prompt): the LRU order decides which blocks are evicted
    SAMPLED_RUN    one greedy prompt and five seeded ones, each with its own filter (top-k, top-p,
                   min-p, none, all three): a bug in one filter changes that prompt's tokens
    STRUCTURED_RUN five prompts, each under a regex (structured_outputs_backend="course"), greedy and
                   seeded: a token mask that lets one wrong token through, or forbids a right one,
                   changes what the random model writes (token_trie)
    GREEDY_RUN     the 4 prompts, greedy: everything else (detokenizer, decode kernel)
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
    "scheduler", tuple(PROMPTS) + ("A short one", {"prompt_token_ids": [7, 8, 9, 10, 11]}), (GREEDY,) * 6,
    (("num_kv_blocks", 7), ("max_num_batched_tokens", 16), ("max_num_seqs", 3)), steps=True)
PREFIX_RUN = Workload(
    "prefix cache", tuple(PROMPTS) + ("The scheduler decides which requests run in each step; the block pool",),
    (GREEDY,) * 5, (("num_kv_blocks", 6), ("max_num_batched_tokens", 32)), steps=True, blocks=True)
SAMPLED_PARAMS = (GREEDY, dict(temperature=0.8, top_k=3, seed=11), dict(temperature=0.3, top_p=0.6, seed=12),
                  dict(temperature=0.5, min_p=0.5, seed=13), dict(temperature=1.0, seed=14),
                  dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.1, seed=15))
SAMPLED_RUN = Workload("sampled", tuple(PROMPTS) + ("A short one", "Seeds make sampling repeatable"),
                       SAMPLED_PARAMS, (("max_num_batched_tokens", 32),))
STRUCTURED_PATTERNS = (r"[0-9]{3}-[0-9]{4}", r'\{"name": "[a-z]{1,8}", "age": [0-9]{1,2}\}', r"(yes|no|maybe)",
                       r"[A-Z][a-z]+( [a-z]+){1,4}\.", r"(0|[1-9][0-9]*)\.[0-9]{2} (EUR|USD)")
STRUCTURED_RUN = Workload(
    "structured", tuple(PROMPTS) + ("A short one",),
    tuple(dict(temperature=0.0 if i % 2 == 0 else 1.0, **({} if i % 2 == 0 else {"seed": 20 + i}),
               structured_outputs=StructuredOutputsParams(regex=pattern))
          for i, pattern in enumerate(STRUCTURED_PATTERNS)),
    (("structured_outputs_backend", "course"),))
WORKLOADS = {"scheduler": SCHEDULER_RUN, "block_pool": PREFIX_RUN, "kv_cache_manager": PREFIX_RUN,
             "sampler": SAMPLED_RUN, "model_runner": SAMPLED_RUN, "block_table": SAMPLED_RUN,
             "token_trie": STRUCTURED_RUN}


def params_text(params: dict) -> str:
    structured = params.get("structured_outputs")
    regex = f"regex {structured.regex!r}, " if structured is not None else ""
    if params.get("temperature", 1.0) == 0.0:
        return regex + "greedy"
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
    sampled = [(set(p) - {"temperature", "seed"}, bad) for p, bad in zip(params, wrong) if p != GREEDY]
    if all(bad for _, bad in sampled):
        return ("every sampled prompt differs: divide by the temperature, then draw each seeded row's noise "
                "from its own generator (generators[row]), the others from self.generator")
    suspects = set.intersection(*[keys for keys, bad in sampled if bad])
    suspects -= set().union(*[keys for keys, bad in sampled if not bad and len(keys) == 1])  # proven right
    if suspects:
        return "; ".join(FILTER_HINTS[name] for name in sorted(suspects) if name in FILTER_HINTS)
    return ("the prompts that differ share no filter that the others lack: check how temperature "
            "reshapes the logits (logits / temperature) and the order temperature, top-k, top-p, min-p")
