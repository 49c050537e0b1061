"""One offline run of one engine, in a fresh process: the child of ``bench vs-vllm``.

It runs under microvllm's Python *and* under vLLM's (which has no microvllm installed),
as a script path, so it imports nothing of microvllm at the top: only the engine it
is asked for, inside ``run``::

    python vs_vllm_offline.py --engine microvllm|vllm --model DIR --dtype float32 \\
        --batch 32 --input-len 128 --output-len 64 --seed 0 --out result.json

Both engines get the same prompts (random token ids, ``prompt_ids``), greedy with
``ignore_eos``, ``max_num_seqs = batch``. One untimed warm-up call first (vLLM
compiles and captures there; microvllm packs nothing late, but pays its first-call
costs too); then one timed ``generate`` of all prompts; then the prefill alone: as many
other prompts of the same length (the first ones are in the prefix cache now), one
output token each, so that no decode step runs. The result file holds both timings,
the start time (process start to engine ready), the peak RSS and every request's output
token ids, which the parent compares.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import time
from pathlib import Path

START = time.perf_counter()


def prompt_ids(batch: int, input_len: int, seed: int, vocab_size: int) -> list[list[int]]:
    """``batch`` prompts of ``input_len`` token ids in 100..4999 (below ``vocab_size``): each
    different, so no prefix cache helps."""
    rng = random.Random(seed)
    top = min(5000, vocab_size)
    return [[rng.randrange(min(100, top - 1), top) for _ in range(input_len)] for _ in range(batch)]


def vocab_size(model: str) -> int:
    with open(Path(model) / "config.json") as f:
        config = json.load(f)
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))


def load_engine(args):
    """``args.engine``'s LLM, built alike for both (the two share the offline API); a
    function that generates greedily from token-id prompts and returns the output ids."""
    if args.engine == "microvllm":
        from microvllm import LLM, SamplingParams
    else:
        from vllm import LLM, SamplingParams
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.batch, seed=args.seed,
              max_model_len=args.input_len + args.output_len + 16)

    def generate(batch, max_tokens=args.output_len):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return generate


def tree_peak_rss_mb() -> float:
    """Peak resident memory of this process and of every process under it that is still
    alive (vLLM's engine core runs in a child process): the sum of their peaks (Linux's
    VmHWM; an upper bound, the peaks need not coincide). Elsewhere: this process's own."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    proc = Path("/proc")
    if not (proc / "self" / "status").exists():
        return own
    parents: dict[int, int] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:   # the fields after the ")" that ends the command name: state, ppid, ...
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, grew = {os.getpid()}, True
    while grew:
        below = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= below
        grew = bool(below)
    total_kb = 0
    for pid in tree:
        try:
            status = (proc / str(pid) / "status").read_text()
        except OSError:
            continue
        total_kb += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return max(total_kb / 1024, own)


def run(args) -> dict:
    vocab = vocab_size(args.model)
    prompts = prompt_ids(args.batch, args.input_len, args.seed, vocab)
    generate = load_engine(args)
    ready_s = time.perf_counter() - START
    generate(prompt_ids(min(args.batch, 2), 16, args.seed + 1, vocab))   # warm-up, untimed
    begin = time.perf_counter()
    token_ids = generate(prompts)
    seconds = time.perf_counter() - begin
    generated = sum(len(t) for t in token_ids)
    begin = time.perf_counter()
    generate(prompt_ids(args.batch, args.input_len, args.seed + 2, vocab), max_tokens=1)
    prefill_s = time.perf_counter() - begin
    return {"engine": args.engine, "dtype": args.dtype, "batch": args.batch, "seconds": seconds,
            "output_tokens": generated, "tok_s": generated / seconds, "start_s": ready_s,
            "prefill_s": prefill_s, "prefill_tok_s": args.batch * args.input_len / prefill_s,
            "peak_rss_mb": tree_peak_rss_mb(),
            "token_ids": token_ids}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("microvllm", "vllm"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
