"""``microvllm generate | bench | serve`` (also ``python -m microvllm ...``).

    microvllm generate "The capital of France is" --max-tokens 24 [--chat] [engine flags]
    microvllm bench throughput [--quick] [--num-prompts N --input-len L --output-len L] [--tensor-parallel-size N]
    microvllm bench attention               (needs a CUDA GPU)
    microvllm bench gpu                     the engine on a CUDA GPU: correctness and speed
    microvllm serve [MODEL] --port 8000 [engine flags]     OpenAI-compatible server
    microvllm bench serve --port 8000 --request-rate 4      load test a running server
    microvllm bench hostile                 what hostile requests cost a server's other clients
    microvllm bench targets                 the engine built for each CPU target (native, avx2, portable)
    microvllm bench vs-vllm --vllm-python P real vLLM (installed in its own environment) side by side
    microvllm collect-env                   this machine: CPU units, kernel target, each kernel, each op's route
    microvllm --version

``microvllm course build|check`` (regenerate and check the exercises) is reachable
too, but left out of the help: it is for the course's maintainers.

A mistake in the arguments prints one line of usage and one line of error and exits
with status 2; so does a setting the engine refuses (no traceback).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from microvllm.cli.parser import FlexibleArgumentParser
from microvllm.cli.serve import add_serve_args, missing_serve_dependencies

SUBCOMMANDS = "{generate,bench,serve,collect-env}"  # the ones the help lists ("course" is hidden)


def build_parser() -> argparse.ArgumentParser:
    from microvllm import __version__
    from microvllm.engine.arg_utils import EngineArgs

    parser = FlexibleArgumentParser(prog="microvllm", description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"microvllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar=SUBCOMMANDS)

    gen = sub.add_parser("generate", help="generate text from a prompt (embedded model by default)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--trace", metavar="OUT.json", default=None, help="record the step trace to a file")
    EngineArgs.add_cli_args(gen.add_argument_group("engine arguments"))

    bench = sub.add_parser("bench", help="benchmarks: bench throughput | bench serve | bench structured | "
                                         "bench hostile | bench targets | bench attention | bench gpu | "
                                         "bench router | bench hybrid | bench kv-tier | bench pd | "
                                         "bench async-scheduling | bench vs-vllm")
    which = bench.add_subparsers(dest="bench", required=True,
                                 metavar="{throughput,serve,structured,hostile,targets,attention,gpu,router,hybrid,"
                                         "kv-tier,pd,async-scheduling,vs-vllm}")
    # Listed here for the help; main() hands the line to their own parsers.
    for name, text in (("throughput", "offline throughput against Hugging Face, and the machine's limits"),
                       ("serve", "load a running server: Poisson arrivals, TTFT / TPOT / ITL"),
                       ("structured", "tokens/s with and without a JSON schema, and the grammar mask's cost"),
                       ("hostile", "a server under hostile requests: the other clients' token gaps, memory"),
                       ("targets", "decode speed with the kernels built for each CPU target, side by side"),
                       ("attention", "attention kernels (needs a CUDA GPU)"),
                       ("gpu", "the engine on a CUDA GPU: tokens vs the CPU, kernels, speed"),
                       ("router", "routing policies side by side on two replicas (vllm-router, the course's)"),
                       ("hybrid", "prefix caching on a hybrid model, with and without state snapshots"),
                       ("kv-tier", "prefix hits and TTFT with and without a second KV tier"),
                       ("pd", "a decode stream's ITL under a prompt flood: colocated vs prefill/decode split"),
                       ("async-scheduling", "offline decode with async scheduling off and on, side by side"),
                       ("vs-vllm", "real vLLM (its own environment) side by side: offline and served, "
                                   "tokens compared")):
        one = which.add_parser(name, help=text, add_help=False)
        one.add_argument("args", nargs=argparse.REMAINDER)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (FastAPI + uvicorn)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(serve)

    sub.add_parser("collect-env", help="this machine's CPU units, kernel target, kernels built and each op's route")
    return parser


def _workload(args: list[str]) -> str | None:
    """The value of ``--workload`` (or ``--workload=...``) among ``args``."""
    for i, arg in enumerate(args):
        if arg.startswith("--workload="):
            return arg.partition("=")[2]
        if arg == "--workload" and i + 1 < len(args):
            return args[i + 1]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Commands with parsers of their own get the rest of the line untouched (argparse's
    # REMAINDER would not pass on a leading --help).
    if argv[:1] == ["course"]:
        from microvllm.course.build import main as course_main
        return course_main(argv[1:])
    parser = build_parser()
    if argv[:1] == ["collect-env"]:
        from microvllm.collect_env import main as collect_env_main
        return collect_env_main(argv[1:])
    if argv[:1] == ["bench"] and argv[1:2] in (["throughput"], ["serve"], ["structured"], ["hostile"], ["targets"],
                                                 ["attention"], ["gpu"], ["router"], ["hybrid"], ["kv-tier"],
                                                 ["pd"], ["async-scheduling"], ["vs-vllm"]):
        if argv[1] == "throughput" and _workload(argv[2:]) == "quantization":   # bench/quantized.py
            from microvllm.bench.quantized import main as bench_main
        elif argv[1] == "throughput" and _workload(argv[2:]) == "moe":   # its own options
            from microvllm.bench.moe import main as bench_main
        elif argv[1] == "throughput" and _workload(argv[2:]) == "lora":   # its own options
            from microvllm.bench.lora import main as bench_main
        elif argv[1] == "throughput":
            from microvllm.bench.throughput import main as bench_main
        elif argv[1] == "serve":
            from microvllm.bench.serve import main as bench_main
        elif argv[1] == "router":
            from microvllm.bench.router import main as bench_main
        elif argv[1] == "hybrid":
            from microvllm.bench.hybrid import main as bench_main
        elif argv[1] == "kv-tier":
            from microvllm.bench.kv_tier import main as bench_main
        elif argv[1] == "pd":
            from microvllm.bench.pd import main as bench_main
        elif argv[1] == "async-scheduling":
            from microvllm.bench.async_scheduling import main as bench_main
        elif argv[1] == "vs-vllm":
            from microvllm.bench.vs_vllm import main as bench_main
        elif argv[1] == "gpu":
            from microvllm.bench.gpu import main as bench_main
        elif argv[1] == "structured":
            from microvllm.bench.structured import main as bench_main
        elif argv[1] == "hostile":
            from microvllm.bench.hostile_sets import main as bench_main
        elif argv[1] == "targets":
            from microvllm.bench.targets import main as bench_main
        else:
            from microvllm.bench.attention import main as bench_main
        return _without_traceback(parser, bench_main, argv[2:])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        missing = missing_serve_dependencies()
        if missing:
            parser.exit(2, f"microvllm: error: `microvllm serve` needs {' and '.join(missing)}, which "
                           "come with the `serve` extra: pip install 'microvllm[serve]' (in a clone: "
                           "pip install -e '.[serve]')\n")
        from microvllm.cli.serve import size_cpu_token_budget
        from microvllm.entrypoints.openai.api_server import run_server

        _without_traceback(parser, size_cpu_token_budget, args)
        return _without_traceback(parser, run_server, args)
    return _without_traceback(parser, _generate, args)


def _without_traceback(parser, command, args) -> int:
    """Run ``command(args)``; a setting the engine refuses (a missing model folder, a
    value out of range) exits 2 with its message, which says what to change."""
    try:
        return command(args)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError) as error:
        parser.exit(2, f"microvllm: error: {error}\n")


def _generate(args) -> int:
    from microvllm import LLM, EngineArgs, SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    engine_args.trace = args.trace is not None
    llm = LLM(**vars(engine_args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens)
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
