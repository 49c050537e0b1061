"""Command line: ``microvllm generate "prompt"``, ``microvllm bench throughput|attention``.

Also reachable as ``python -m microvllm ...``.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    if argv[:1] == ["course"]:
        from microvllm.course.build import main as course_main
        return course_main(argv[1:])
    parser = argparse.ArgumentParser(prog="microvllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt (embedded model by default)")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="a Hugging Face model folder (default: embedded SmolLM2)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--trace", metavar="OUT.json", default=None, help="record the step trace to a file")
    sub.add_parser("bench", help="benchmarks: bench throughput | bench attention")
    sub.add_parser("course", help="course build: regenerate exercises and solutions")
    args = parser.parse_args(argv)
    return _generate(args)


def _generate(args) -> int:
    from microvllm import LLM, SamplingParams

    llm = LLM(args.model, trace=args.trace is not None)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    start = time.perf_counter()
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    completion = out.outputs[0]
    print(args.prompt + completion.text if not args.chat else completion.text)
    print(f"[{len(out.prompt_token_ids)} prompt + {len(completion.token_ids)} generated tokens in "
          f"{elapsed:.2f} s: {len(completion.token_ids) / elapsed:.1f} tokens/s, "
          f"finish_reason={completion.finish_reason}]", file=sys.stderr)
    if args.trace:
        llm.trace.save(args.trace)
        print(f"[trace of {len(llm.trace)} steps written to {args.trace}]", file=sys.stderr)
    return 0


def _bench(argv: list[str]) -> int:
    which = argv[:1]
    if which == ["attention"]:
        from microvllm.bench.attention import main as bench_main
    elif which == ["throughput"]:
        from microvllm.bench.throughput import main as bench_main
    else:
        print("usage: microvllm bench {throughput,attention} [options]", file=sys.stderr)
        return 2
    return bench_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
