"""``microvllm bench async-scheduling``: offline decode with async scheduling off and on.

    python -m microvllm bench async-scheduling [--model FOLDER] [--batches 1,32] [--quick]

Two engines on the same weights, one with ``async_scheduling=True`` (the core plans step
N+1 while step N's forward runs on its execute thread), each warmed up, then timed in
turn on the same greedy workload (``--repeat`` rounds: a shared machine's speed drifts,
so only runs made side by side compare). Per batch size: output tokens/s of each (the
median round), the median of the rounds' on/off ratios, and whether the token ids are
identical (reported, never asserted: the tests assert it).

What to expect: the overlap hides the scheduler's and the input preparation's time
behind the forward. On a GPU the forward runs on the device, so the host's work is
free; on a CPU the forward runs on the same cores the scheduler needs, so the overlap
buys only what the forward leaves idle (its single-threaded parts), and the hand-off
between two threads costs something back.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from microvllm.bench.roofline import cpu_description


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="microvllm bench async-scheduling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true", help="the lesson path (no decode fast path)")
    parser.add_argument("--quick", action="store_true", help="a tiny random model, short runs (CI)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from microvllm import LLM, SamplingParams

    model = args.model
    if args.quick:
        import tempfile
        from pathlib import Path

        from microvllm.models.tiny import make_tiny_model
        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "llama", "llama", seed=1))
        args.output_len, args.repeat = min(args.output_len, 16), 1
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.prompt_len + args.output_len + 1
    engines = {on: LLM(model, async_scheduling=on, max_model_len=max(max_len, 128), max_num_seqs=max(batches),
                       enforce_eager=args.enforce_eager)
               for on in (False, True)}
    vocab = engines[False].llm_engine.config.model_config.hf_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    print(f"CPU: {cpu_description()}")
    print(f"model: {model or 'the embedded default'}; prompt {args.prompt_len} tokens, {args.output_len} out, "
          f"greedy; {args.repeat} round(s), off and on in turn")
    print(f"{'batch':>5}  {'off tok/s':>10}  {'on tok/s':>10}  {'on/off':>7}  identical")
    for batch in batches:
        prompts = [{"prompt_token_ids": [rng.randrange(32, vocab) for _ in range(args.prompt_len)]}
                   for _ in range(batch)]
        tokens, rates, ratios = {}, {False: [], True: []}, []
        for on in (False, True):   # warm-up (and the token ids)
            tokens[on] = [o.outputs[0].token_ids for o in engines[on].generate(prompts, params, use_tqdm=False)]
        for _ in range(args.repeat):
            pair = {}
            for on in (False, True):
                start = time.perf_counter()
                engines[on].generate(prompts, params, use_tqdm=False)
                pair[on] = batch * args.output_len / (time.perf_counter() - start)
                rates[on].append(pair[on])
            ratios.append(pair[True] / pair[False])
        print(f"{batch:>5}  {statistics.median(rates[False]):>10.1f}  {statistics.median(rates[True]):>10.1f}  "
              f"{statistics.median(ratios):>6.2f}x  {tokens[True] == tokens[False]}")
    for engine in engines.values():
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
