"""``python -m microvllm bench gpu``: the one prepared check of the engine on a CUDA GPU.

    1. correctness   greedy ids on CUDA = the CPU engine's (tiny Llama, Mistral, Qwen3,
                     float32; with CUDA graphs and with enforce_eager); the Triton
                     kernels = the torch reference on fresh inputs (float32, bfloat16)
    2. attention     the table of ``bench attention`` (bandwidth as a fraction of a copy)
    3. end to end    a random-weight Llama-3.2-1B shape built on the GPU: tokens/s of the
                     engine with CUDA graphs and eager, a batch-1 decode step each way,
                     and Hugging Face ``generate`` as a static batch on the same weights

It needs no embedded model (nothing is converted, ``gguf`` is never imported) and no
network; it prints one table per part and a summary against the targets:

    Triton decode kernel >= 60% of copy bandwidth (batch >= 64, context >= 2k)   (table 2)
    CUDA graphs >= 2x eager for a batch-1 decode step of the 1B shape
    the engine ahead of Hugging Face's static batch

Without CUDA it refuses, saying where to run it. The parts run on a CPU too (the tests
call them with tiny shapes): ``bench/gpu_checks.py``, ``bench/gpu_speed.py``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from microvllm.bench.throughput import random_workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="microvllm bench gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: "
                                                   "correctness,attention,end-to-end")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench gpu checks the engine on a CUDA GPU, and torch sees none here "
              "(torch.cuda.is_available() is False): run it on a machine with an NVIDIA GPU "
              "(a Colab GPU runtime will do). On a CPU, `microvllm bench throughput` measures "
              "the engine.", file=sys.stderr)
        return 1
    skip = set(filter(None, args.skip.split(",")))
    start = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    failed = 0
    if "correctness" not in skip:
        failed += correctness()
        print(f"[{time.perf_counter() - start:.0f} s]")
    if "attention" not in skip:
        from microvllm.bench import attention
        print("\n== 2. attention kernels (bfloat16) ==")
        attention.main(["--decode-batches", "1,64,256", "--prefill-batches", "1,4",
                        "--contexts", "2048,8192", "--no-reference", "--repeats", "10"])
        print(f"[{time.perf_counter() - start:.0f} s]")
    if "end-to-end" not in skip:
        end_to_end(args)
        print(f"[{time.perf_counter() - start:.0f} s]")
    return 1 if failed else 0


def correctness() -> int:
    from microvllm.bench.gpu_checks import engine_parity, kernel_parity

    print("\n== 1. correctness ==")
    checks = engine_parity("cuda")
    checks += kernel_parity("cuda", torch.float32) + kernel_parity("cuda", torch.bfloat16)
    for check in checks:
        print(check.line())
    failed = sum(not c.passed for c in checks)
    print(f"  {len(checks) - failed}/{len(checks)} passed")
    return failed


def end_to_end(args) -> None:
    from microvllm.bench.gpu_speed import LLAMA_3_2_1B, build_random_model, engine_speed, hf_static_batch

    print("\n== 3. end to end: random-weight Llama-3.2-1B shape, bfloat16 ==")
    workload = random_workload(args.num_prompts, (args.input_len // 2, args.input_len),
                               (args.output_len, args.output_len), LLAMA_3_2_1B["vocab_size"], seed=0)
    with tempfile.TemporaryDirectory(prefix="microvllm-1b-") as folder:
        hf = build_random_model(Path(folder), "cuda", torch.bfloat16)
        hf_result = hf_static_batch(hf, workload)
        del hf
        torch.cuda.empty_cache()
        settings = dict(max_model_len=args.input_len + args.output_len + 64,
                        max_num_seqs=args.num_prompts, gpu_memory_utilization=args.gpu_memory_utilization)
        graphs, graphs_step = engine_speed(Path(folder), "cuda", "bfloat16", workload, enforce_eager=False,
                                           **settings)
        eager, eager_step = engine_speed(Path(folder), "cuda", "bfloat16", workload, enforce_eager=True,
                                         **settings)
    print(f"  {args.num_prompts} requests, prompts {args.input_len // 2}-{args.input_len}, "
          f"{args.output_len} output tokens each")
    print(f"  {'':34}{'output tok/s':>14}{'wall s':>9}")
    for result in (graphs, eager, hf_result):
        print(f"  {result.name:34}{result.useful_rate:>14.0f}{result.wall_s:>9.2f}")
    print(f"  batch-1 decode step: CUDA graphs {graphs_step * 1e3:.2f} ms, eager {eager_step * 1e3:.2f} ms")
    print("\n== summary against the targets ==")
    speedup = eager_step / graphs_step
    print(f"  CUDA graphs vs eager, batch-1 step: {speedup:.1f}x (target >= 2x) "
          f"{'ok' if speedup >= 2 else 'MISSED'}")
    ahead = graphs.useful_rate / hf_result.useful_rate
    print(f"  engine vs HF static batch: {ahead:.2f}x (target > 1x) {'ok' if ahead > 1 else 'MISSED'}")
    print("  Triton decode kernel vs copy bandwidth (target >= 60% at batch >= 64, context >= 2k): "
          "the 'of copy' column of table 2")
