"""``microvllm bench targets``: the engine with its kernels built for each CPU target,
side by side on one machine, so that one AVX-512 box can say what an AVX2 laptop or a
machine with no vector kernels gets.

    target      MICROVLLM_CPU_ISA   torch's three CPU libraries capped to the same class
                                    (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS)
    native      (unset)             (not capped)
    avx512      avx512              avx512, AVX512_CORE, AVX512
    avx2        avx2                avx2, AVX2, AVX2
    portable    portable            default, SSE41, SSE4_2

(All three caps matter: ``F.linear`` runs MKL, the packed GEMM oneDNN, the rest ATen's
own kernels; leave one uncapped and the baseline runs a class the target does not.)
For each target four engines on the embedded model: float32 with ``enforce_eager=True``
(torch ops only: the baseline), float32 by default (the kernels, the decode fast path
where it applies), and the Q4_1 GGUF file with ``enforce_eager=True`` (dequantized in
torch at every call) and by default. Each run is a fresh process (the
target is fixed when the kernels load); runs take turns, ``--repeat`` rounds, and each
figure is the median over rounds of the median decode-only step
(``throughput.decode_steps``). A shared machine's speed drifts over minutes: only
figures from one run compare. Emulating a laptop on a bigger CPU keeps its cache and
memory bandwidth, so the ratios carry over better than the tokens per second do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

TARGETS = {
    "native": {},
    "avx512": {"MICROVLLM_CPU_ISA": "avx512", "ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2": {"MICROVLLM_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "portable": {"MICROVLLM_CPU_ISA": "portable", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                 "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
ENGINES = ("f32 eager", "f32", "Q4_1 eager", "Q4_1")


def measure(engine: str, batches: list[int], prompt_len: int, output_len: int, seed: int) -> dict:
    """In this (fresh) process: median decode-only step of ``engine`` at each batch size."""
    import torch

    from microvllm import LLM
    from microvllm.bench.roofline import ModelCost
    from microvllm.bench.throughput import decode_steps
    from microvllm.models.default_model import default_model_path, find_gguf

    folder = str(default_model_path())
    model = str(find_gguf()) if engine.startswith("Q4_1") else folder
    llm = LLM(model=model, enforce_eager=engine.endswith("eager"), max_num_seqs=max(batches))
    fast_path = llm.engine.executor.worker.model_runner.decode_step_runner is not None
    cost = ModelCost.from_folder(folder, torch.float32)
    steps = {}
    for batch in batches:
        times, _ = decode_steps(llm, cost, batch, prompt_len, output_len, seed + batch)
        steps[batch] = statistics.median(times)
    return {"step_s": steps, "fast_path": fast_path}


def _child(target: str, engine: str, spec: dict) -> dict:
    code = ("import json, sys; from microvllm.bench import targets as t; "
            "print('RESULT ' + json.dumps(t.measure(**json.loads(sys.argv[1]))))")
    env = {**os.environ, **TARGETS[target]}
    done = subprocess.run([sys.executable, "-c", code, json.dumps({"engine": engine, **spec})],
                          capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result["step_s"] = {int(k): v for k, v in result["step_s"].items()}
            result["warnings"] = [w for w in done.stderr.splitlines() if w.startswith("microvllm warning")]
            return result
    raise RuntimeError(f"{target} / {engine} failed (exit status {done.returncode}):\n{done.stderr[-3000:]}")


def runnable(target: str) -> str | None:
    """None if this machine can run ``target``'s kernels, else why not."""
    from microvllm.platforms.cpu import kernels

    try:
        kernels.check_target(TARGETS[target].get("MICROVLLM_CPU_ISA", "native"))
    except kernels.KernelUnavailable as error:
        return str(error)
    return None


def bench(args) -> dict:
    from microvllm.collect_env import cpu_model

    targets = []
    for target in args.targets:
        reason = runnable(target)
        if reason:
            print(f"{target}: skipped ({reason})")
        else:
            targets.append(target)
    spec = {"batches": args.batches, "prompt_len": args.prompt_len, "output_len": args.output_len, "seed": args.seed}
    print(f"bench targets on {cpu_model()}, {os.cpu_count()} cores, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}: {args.repeat} rounds, each run a fresh process; decode-only "
          f"steps after {args.prompt_len}-token prompts, {args.output_len} outputs (median step)")
    runs: dict[tuple[str, str], list[dict]] = {(t, e): [] for t in targets for e in ENGINES}
    for _ in range(args.repeat):
        for target in targets:
            for engine in ENGINES:
                runs[target, engine].append(_child(target, engine, spec))
    tok_s = {key: {b: b / statistics.median(r["step_s"][b] for r in results) for b in args.batches}
             for key, results in runs.items()}
    for target in targets:
        caps = " ".join(f"{k}={v}" for k, v in TARGETS[target].items()) or "kernels and torch as this CPU allows"
        print(f"\n{target}  ({caps})")
        print(f"  {'engine':<10}{'fast path':>10}" + "".join(f"{f'batch {b} tok/s':>16}{'x eager':>9}"
                                                           for b in args.batches))
        for engine in ENGINES:
            result = runs[target, engine][0]
            row = f"  {engine:<10}{'on' if result['fast_path'] else 'off':>10}"
            for b in args.batches:   # against the same weights' eager run
                value, eager = tok_s[target, engine][b], tok_s[target, engine.split()[0] + " eager"][b]
                row += f"{value:>16.1f}{value / eager:>8.2f}x"
            print(row)
        for warning in sorted({w for r in runs[target, "f32"] + runs[target, "Q4_1"] for w in r["warnings"]}):
            print(f"  ({warning})")
    print("\nchecks (issue 39):")
    checks = {}
    for target in targets:
        b1 = args.batches[0]
        q4 = tok_s[target, "Q4_1"][b1] / tok_s[target, "f32"][b1]
        f32 = tok_s[target, "f32"][b1] / tok_s[target, "f32 eager"][b1]
        worst = min(tok_s[target, w][b] / tok_s[target, f"{w} eager"][b] for w in ("f32", "Q4_1") for b in args.batches)
        checks[target] = {"q4_1_over_f32": q4, "f32_over_eager": f32, "worst_over_eager": worst}
        if TARGETS[target].get("MICROVLLM_CPU_ISA") == "portable":   # no vector kernels: only "no slower"
            print(f"  {target:<9} batch {b1}: Q4_1 / f32 {q4:.2f}x, f32 / eager {f32:.2f}x; default / eager, "
                  f"worst of both weights and every batch {worst:.2f}x (wanted >= 1)")
        else:
            print(f"  {target:<9} batch {b1}: Q4_1 / f32 {q4:.2f}x (wanted >= 2), f32 / eager {f32:.2f}x "
                  f"(wanted >= 1.3); default / eager, worst of both weights and every batch {worst:.2f}x "
                  "(wanted >= 1)")
    return checks


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="microvllm bench targets", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", default=["native", "avx2", "portable"], choices=list(TARGETS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    bench(parse_args(sys.argv[1:] if argv is None else list(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
