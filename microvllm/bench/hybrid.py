"""``microvllm bench hybrid``: prefix caching on a hybrid model, with and without state snapshots.

    python -m microvllm bench hybrid [--quick] [--model FOLDER] [--block-size 16]

A random Qwen3.5 (Gated DeltaNet layers beside full attention; ``--model`` runs a
Qwen3.5 folder instead) serves a multi-tenant workload in waves: ``--num-prefixes``
system prompts, half of them shorter than the engine's block size (vLLM issue #40696's
case) and half several blocks long, each followed by a different question in every wave;
a wave starts when the one before finished (so its snapshots are computed). On the same
weights and workload, one engine per setting::

    mamba_cache_mode="none"   no snapshots: the state of a prefix exists nowhere, a hybrid
                              never hits (every group must be able to resume)
    mamba_cache_mode="all"    a snapshot at every block boundary: a hit resumes from the
                              last snapshot the prompt's blocks reach

Per setting and prefix class: prefix-cache hit rate (hit tokens / prompt tokens of every
request after the first wave), prompt tokens computed, the time of the later waves, and
that the greedy tokens are identical across settings. The block size is the engine's:
raised until a page holds a state (``--block-size`` is the floor), which is what makes
short system prompts miss.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from microvllm.bench.roofline import cpu_description

MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=32, linear_value_head_dim=32, vocab_size=4096, max_position_embeddings=4096)
QUICK = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             vocab_size=512, max_position_embeddings=1024)


@dataclass
class Result:
    mode: str
    block_size: int
    hit: dict[str, int]          # prefix class -> hit tokens (waves after the first)
    prompt: dict[str, int]       # prefix class -> prompt tokens (waves after the first)
    computed: int                # prompt tokens computed, every wave
    seconds: float               # the waves after the first
    tokens: list[tuple[int, ...]]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="microvllm bench hybrid", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Qwen3.5 folder (default: a random one, written here)")
    parser.add_argument("--block-size", type=int, default=16, help="the block size asked for (the engine may raise it)")
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--waves", type=int, default=4, help="questions per system prompt, one per wave")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a tiny model and workload (the test)")
    return parser.parse_args(argv)


def make_model(folder: Path, quick: bool) -> Path:
    from microvllm.models.tiny import make_tiny_model
    return make_tiny_model(folder, "qwen3_5", seed=0, tokenizer=False, **(QUICK if quick else MODEL))


def workload(num_prefixes: int, waves: int, block_size: int, vocab: int, seed: int):
    """[(class, system prompt)], and per wave one prompt per system prompt."""
    rng = random.Random(seed)
    systems = []
    for i in range(num_prefixes):
        short = i % 2 == 0
        length = rng.randint(max(2, block_size // 2), block_size - 1) if short else \
            rng.randint(3 * block_size, 6 * block_size)
        systems.append(("shorter than a block" if short else "several blocks",
                        [rng.randrange(3, vocab) for _ in range(length)]))
    per_wave = [[(kind, system + [rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))])
                 for kind, system in systems] for _ in range(waves)]
    return per_wave


def run(model: Path, mode: str, waves, args) -> Result:
    from microvllm import LLM, SamplingParams
    llm = LLM(str(model), trace=True, block_size=args.block_size, mamba_cache_mode=mode, max_model_len=1024,
              enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    hit: dict[str, int] = {}
    prompt: dict[str, int] = {}
    tokens, computed, seconds = [], 0, 0.0
    for index, wave in enumerate(waves):
        start, started = len(llm.trace), time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for _, p in wave], params, use_tqdm=False)
        if index:
            seconds += time.perf_counter() - started
        tokens += [tuple(o.outputs[0].token_ids) for o in outs]
        hits = {}
        for step in list(llm.trace)[start:]:
            for r in step.scheduled:
                if r.prefix_hit_tokens is not None:
                    hits[r.request_id] = r.prefix_hit_tokens
        for (kind, p), out in zip(wave, outs):
            got = hits.get(out.request_id, 0)
            computed += len(p) - got
            if index:
                hit[kind] = hit.get(kind, 0) + got
                prompt[kind] = prompt.get(kind, 0) + len(p)
    return Result(mode, llm.engine.config.cache_config.block_size, hit, prompt, computed, seconds, tokens)


def table(results: list[Result]) -> str:
    kinds = list(results[0].prompt)
    lines = [f"{'mamba_cache_mode':<18}{'block':>6}" + "".join(f"{'hit ' + k:>28}" for k in kinds)
             + f"{'hit all':>10}{'prompt tokens computed':>25}{'later waves s':>15}"]
    for r in results:
        cells = "".join(f"{100 * r.hit.get(k, 0) / r.prompt[k]:>27.1f}%" for k in kinds)
        total = 100 * sum(r.hit.values()) / sum(r.prompt.values())
        lines.append(f"{r.mode:<18}{r.block_size:>6}{cells}{total:>9.1f}%{r.computed:>25}{r.seconds:>15.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.num_prefixes, args.waves, args.max_tokens = 4, 2, 4
    with tempfile.TemporaryDirectory(prefix="bench-hybrid-") as scratch:
        model = Path(args.model) if args.model else make_model(Path(scratch) / "qwen3_5", args.quick)
        from microvllm.engine.arg_utils import EngineArgs
        from microvllm.models.loader import load_config
        hf_config = load_config(model)
        block_size = EngineArgs(model=str(model), block_size=args.block_size).create_engine_config(
            hf_config=hf_config).cache_config.block_size
        waves = workload(args.num_prefixes, args.waves, block_size, hf_config.vocab_size, args.seed)
        print(f"{cpu_description()}\nmodel {model} ({hf_config.num_hidden_layers} layers: "
              f"{hf_config.layer_types.count('linear_attention')} Gated DeltaNet, "
              f"{hf_config.layer_types.count('full_attention')} full attention); block size {block_size} "
              f"(asked {args.block_size}); {args.num_prefixes} system prompts x {args.waves} waves", flush=True)
        results = [run(model, mode, waves, args) for mode in ("none", "all")]
    print(table(results))
    same = results[0].tokens == results[1].tokens
    print(f"greedy tokens identical with and without snapshots: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
