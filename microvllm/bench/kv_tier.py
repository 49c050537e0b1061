"""``microvllm bench kv-tier``: prefix hits and time to first token with and without the
second KV tier (``OffloadingConnector``), on a workload whose shared prefixes do not fit
the pool.

    workload   N shared prefixes (system prompts) of P tokens, each request one of them
               (chosen at random) + a short question; requests one after another
    pool       num_kv_blocks: by default half of the prefixes' blocks (+ the null block),
               so LRU has evicted a prefix by the time it comes back
    tier       num_cpu_blocks: by default twice the prefixes' blocks, so that it holds every
               prefix besides each request's own last blocks (a tier smaller than what cycles
               through it thrashes under LRU, as the pool does)

For each run: the prefix-cache hit rate (hit tokens / prompt tokens, tier hits included),
TTFT (a request's arrival to its first token) p50 / p90, the wall time, the tier's blocks
loaded and saved; greedy tokens are compared and must be identical.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="microvllm bench kv-tier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small run on a tiny random model (structure, "
                                                              "not figures)")
    parser.add_argument("--model", default=None, help="'tiny', a model folder, or (default) the embedded model")
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: half the prefixes' blocks + 1")
    parser.add_argument("--num-cpu-blocks", type=int, default=None, help="default: 2x the prefixes' blocks")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.model = args.model or "tiny"
        args.num_prefixes, args.prefix_tokens, args.num_requests, args.max_tokens = 4, 48, 12, 4
        args.block_size, args.question_tokens = 8, 5
    return args


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(100, vocab_size - 100) for _ in range(args.prefix_tokens)]
                for _ in range(args.num_prefixes)]
    return [rng.choice(prefixes) + [rng.randrange(100, vocab_size - 100) for _ in range(args.question_tokens)]
            for _ in range(args.num_requests)]


def run(model: str, prompts: list[list[int]], args: argparse.Namespace, kv_transfer_config: dict | None) -> dict:
    """The requests one after another through ``Engine.step``; TTFT from each arrival."""
    from microvllm import LLM, SamplingParams

    llm = LLM(model, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_num_seqs=4,
              kv_transfer_config=kv_transfer_config, seed=args.seed)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    ttfts, tokens = [], []
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        arrival = time.perf_counter()
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, params)
        first, out = None, None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if first is None and output.outputs[0].token_ids:
                    first = time.perf_counter() - arrival
                if output.finished:
                    out = output
        assert first is not None and out is not None
        ttfts.append(first)
        tokens.append(list(out.outputs[0].token_ids))
    wall = time.perf_counter() - started
    connector = engine.scheduler.connector
    return {"hit_rate": engine.prefix_cache_hits / max(engine.prefix_cache_queries, 1),
            "ttft_p50": statistics.median(ttfts), "ttft_p90": sorted(ttfts)[int(0.9 * (len(ttfts) - 1))],
            "wall": wall, "tokens": tokens,
            "loaded": getattr(connector, "num_blocks_loaded", 0), "saved": getattr(connector, "num_blocks_saved", 0)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-kv-tier-") as scratch:
        from microvllm.bench.router import resolve_model
        from microvllm.models.loader import load_config

        model = resolve_model(args.model, Path(scratch))
        prompts = make_prompts(args, load_config(model).vocab_size)
        prefix_blocks = args.num_prefixes * (args.prefix_tokens // args.block_size)
        if args.num_kv_blocks is None:
            request_blocks = -(-(args.prefix_tokens + args.question_tokens + args.max_tokens) // args.block_size)
            args.num_kv_blocks = max(prefix_blocks // 2, request_blocks) + 1
        if args.num_cpu_blocks is None:
            args.num_cpu_blocks = 2 * prefix_blocks
        tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"num_cpu_blocks": args.num_cpu_blocks}}
        print(f"model {model}\n{args.num_prefixes} prefixes of {args.prefix_tokens} tokens ({prefix_blocks} "
              f"blocks of {args.block_size}), {args.num_requests} requests one after another, "
              f"{args.question_tokens}-token questions, {args.max_tokens} output tokens; pool "
              f"{args.num_kv_blocks} blocks, tier {args.num_cpu_blocks} blocks", flush=True)
        results = {name: run(model, prompts, args, config) for name, config in (("no tier", None), ("tier", tier))}
    print(f"{'':10} {'hit rate':>9} {'TTFT p50':>10} {'TTFT p90':>10} {'wall':>8} {'loaded':>7} {'saved':>6}")
    for name, r in results.items():
        print(f"{name:10} {r['hit_rate']:9.1%} {r['ttft_p50'] * 1e3:8.1f}ms {r['ttft_p90'] * 1e3:8.1f}ms "
              f"{r['wall']:7.2f}s {r['loaded']:7d} {r['saved']:6d}")
    same = results["tier"]["tokens"] == results["no tier"]["tokens"]
    print(f"greedy tokens identical: {'yes' if same else 'NO'}")
    return 0 if same else 1
