"""``microvllm bench throughput --workload moe``: the three ways to run a mixture of experts, side by side.

A random Qwen3-MoE is written to a temporary folder (``make_tiny_model`` with overrides;
``--model`` runs an existing MoE folder instead), then, on the same weights and workload:

    layer     one FusedMoE layer's experts on T rows, the same routing for each step:
              (a) iterative  loop over experts, each scanning topk_ids (moe_torch_iterative.py)
              (b) sorted     sort the pairs by expert once, one matmul pair each (moe_sorted.py)
              (c) triton     one kernel launch for all experts (fused_moe.py): timed only where
                             it runs natively (CUDA); on a CPU the Triton interpreter is a
                             correctness check, not a speed figure, so it is skipped
    engine    ``LLM.generate`` (greedy, ignore_eos) with MICROVLLM_MOE_IMPL=iterative, =sorted and
              unset (the device's default), each with enforce_eager=True (the plain torch code
              the notebooks show) and without (the engine's fast paths)
    HF        transformers ``generate`` on one left-padded batch (as ``--workload random`` does)

and every engine run's greedy token ids are compared with HF's (agree / disagree).

The model (full run): 16 experts, top-2, hidden 512, moe_intermediate_size 256, 4 layers, all
sparse (mlp_only_layers=[]), vocab 4096. Why this size: it holds ~25M expert parameters
but a token uses only 2 of 16 experts, ~3M of them, so of the ~28M parameters of the
decoder layers a token uses ~6M (experts ~3M + attention ~3M), a fifth; with the embedding
and lm_head (2M each) ~10M of ~32M (128 MB in float32; the header line prints both).
A decode step of 16 requests routes 32 pairs over 16 experts: nearly every expert runs
on one or two rows, so the per-expert overhead (step (a) scans topk_ids 16 times per
layer; step (b) sorts once) is what the comparison shows, while each matmul stays small
enough for two CPU cores. The vocabulary is kept small (4096, not 150k) so
that the lm_head does not hide the experts.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from microvllm.bench.roofline import cpu_description
from microvllm.bench.throughput import (
    RunResult,
    _first_divergence,
    _identical,
    _positive,
    _range,
    hf_static_batch,
    hf_warm_up,
    load_hf,
    microvllm_generate,
    random_workload,
)

MODEL = dict(num_experts=16, num_experts_per_tok=2, hidden_size=512, moe_intermediate_size=256,
             intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, vocab_size=4096, mlp_only_layers=[])
QUICK_MODEL = dict(num_experts=8, num_experts_per_tok=2, hidden_size=128, moe_intermediate_size=64,
                   intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, vocab_size=1024, mlp_only_layers=[])
FULL = dict(num_requests=16, prompt_lens=(64, 128), output_lens=(32, 64), layer_rows=[16, 512], repeat=5)
QUICK = dict(num_requests=4, prompt_lens=(16, 32), output_lens=(8, 12), layer_rows=[4, 64], repeat=3)
IMPLS = ("iterative", "sorted")


# ------------------------------------------------------------------- one layer
def _time(fn, repeat: int, cuda: bool) -> float:
    """Median seconds of ``fn()`` over ``repeat`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def triton_runs_natively() -> str | None:
    """None where step (c) runs natively (CUDA + triton), else why it is skipped."""
    if not torch.cuda.is_available():
        return "skipped: no CUDA GPU (the Triton interpreter on a CPU checks, it does not time)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "skipped: triton is not installed"
    return None


@torch.inference_mode()
def bench_layer(llm, rows: list[int], repeat: int, seed: int) -> None:
    """The first MoE layer of the engine's model: its experts on T random rows (routed by its
    own gate), each step timed on the same routing; results compared with step (a)."""
    from microvllm.layers.fused_moe.layer import EXPERT_FUNCTIONS, moe_layers
    from microvllm.layers.fused_moe.router import select_experts

    model = llm.engine.executor.worker.model
    index, layer = next(iter(moe_layers(model).items()))
    gate = dict(model.named_modules())[_parent(dict(model.named_modules()), layer)].gate
    w13, w2 = layer.w13_weight, layer.w2_weight
    print(f"one MoE layer (layer {index}: {layer.global_num_experts} experts, top-{layer.top_k}, hidden "
          f"{layer.hidden_size}, intermediate {layer.intermediate_size}), {w13.dtype}, median of {repeat}; "
          "the experts only, same routing for each step:")
    print(f"{'':16}" + "".join(f"{f'T={t} rows':>22}" for t in rows))
    generator = torch.Generator().manual_seed(seed)
    inputs = {}
    for t in rows:
        hidden = torch.randn(t, layer.hidden_size, generator=generator).to(w13.dtype).to(w13.device)
        topk_weights, topk_ids = select_experts(gate(hidden), layer.top_k, layer.renormalize)
        inputs[t] = (hidden, topk_weights, topk_ids)
    base: dict[int, float] = {}
    reference: dict[int, torch.Tensor] = {}
    for label, impl in (("(a) iterative", "iterative"), ("(b) sorted", "sorted"), ("(c) triton", "triton")):
        row = f"{label:16}"
        if impl == "triton":
            why = triton_runs_natively()
            if why is not None:
                print(f"{label:16}  {why}")
                continue
        cells = []
        for t, (hidden, topk_weights, topk_ids) in inputs.items():
            args = (hidden, w13, w2, topk_weights, topk_ids)
            if impl == "triton" and hidden.device.type != "cuda":
                args = tuple(a.cuda() for a in args)
            run = EXPERT_FUNCTIONS[impl]
            seconds = _time(lambda: run(*args), repeat, args[0].device.type == "cuda")
            out = run(*args).to(hidden.device).float()
            reference.setdefault(t, out)
            base.setdefault(t, seconds)
            diff = (out - reference[t]).abs().max().item()
            cells.append(f"{seconds * 1e3:9.2f} ms {base[t] / seconds:4.1f}x" + (f" (max diff {diff:.1e})"
                                                                                 if diff > 1e-4 else ""))
        print(row + "".join(f"{c:>22}" for c in cells))
    print("  (x = speed relative to (a) on the same rows)")
    sys.stdout.flush()


def _parent(modules: dict, layer) -> str:
    """The name of the module that holds ``layer`` as ``.experts`` (the block with the gate)."""
    name = next(n for n, m in modules.items() if m is layer)
    return name.rsplit(".", 1)[0]


# ------------------------------------------------------------------ the engine
@contextmanager
def moe_impl(impl: str | None):
    """Set (or, for None, unset) ``MICROVLLM_MOE_IMPL`` for the block; restore it after."""
    saved = os.environ.get("MICROVLLM_MOE_IMPL")
    if impl is None:
        os.environ.pop("MICROVLLM_MOE_IMPL", None)
    else:
        os.environ["MICROVLLM_MOE_IMPL"] = impl
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MICROVLLM_MOE_IMPL", None)
        else:
            os.environ["MICROVLLM_MOE_IMPL"] = saved


def _llm(model_path: Path, args, enforce_eager: bool):
    from microvllm import LLM

    return LLM(str(model_path), dtype="float32", seed=args.seed, enforce_eager=enforce_eager)


def _default_impl(llm) -> str:
    from microvllm.layers.fused_moe.layer import moe_layers

    layer = next(iter(moe_layers(llm.engine.executor.worker.model).values()))
    return layer.impl


def _row(name: str, result: RunResult, hf: RunResult | None, verdict: str) -> None:
    ratio = f"{hf.wall_s / result.wall_s:.2f}x" if hf is not None else "-"
    print(f"{name:40}{result.useful_rate:>12.1f}{result.total_rate:>13.1f}{result.wall_s:>9.2f}{ratio:>8}  {verdict}")
    sys.stdout.flush()


def _verdict(result: RunResult, hf: RunResult | None) -> str:
    if hf is None:
        return "not compared (--skip-hf)"
    same = _identical(result.outputs, hf.outputs)
    word = "agree" if same == len(hf.outputs) else "DISAGREE"
    return f"{word} {same}/{len(hf.outputs)}{_first_divergence(result.outputs, hf.outputs)}"


def bench_engine(args, model_path: Path, vocab_size: int) -> None:
    workload = random_workload(args.num_requests, args.prompt_lens, args.output_lens, vocab_size, args.seed)
    (p_lo, p_hi), (o_lo, o_hi) = args.prompt_lens, args.output_lens
    print(f"\nworkload: {args.num_requests} requests, prompts {p_lo}-{p_hi}, outputs {o_lo}-{o_hi} (seed "
          f"{args.seed}), {workload.num_prompt_tokens:,} prompt + {workload.num_output_tokens:,} output tokens, "
          "random ids, ignore_eos, greedy, float32")
    hf = None
    if not args.skip_hf:
        model, pad_id = load_hf(model_path, torch.float32)
        hf_warm_up(model, pad_id, workload)
        hf = hf_static_batch(model, pad_id, workload)
        del model
        gc.collect()
    print(f"{'':40}{'output tok/s':>12}{'total tok/s':>13}{'wall s':>9}{'x HF':>8}  greedy ids vs HF")
    if hf is not None:
        _row("HF static batch", hf, hf, "(the reference)")
    else:
        print(f"{'HF static batch':40}{'skipped (--skip-hf)':>42}")
    rates: dict[tuple[str, bool], float] = {}
    for impl in (*IMPLS, None):
        for eager in (True, False):
            with moe_impl(impl):
                llm = _llm(model_path, args, eager)
                name = impl or f"default ({_default_impl(llm)})"
                microvllm_generate(llm, random_workload(2, (8, 8), (2, 2), vocab_size, args.seed + 1))  # warm up
                result, _ = microvllm_generate(llm, workload)
            del llm
            gc.collect()
            rates[(name.split(" ")[0], eager)] = result.useful_rate
            _row(f"microvllm {name}, {'eager' if eager else 'not eager'}", result, hf, _verdict(result, hf))
    for eager in (True, False):
        if rates.get(("iterative", eager)):
            print(f"sorted / iterative ({'eager' if eager else 'not eager'}): "
                  f"{rates[('sorted', eager)] / rates[('iterative', eager)]:.2f}x")
    print("  (eager: enforce_eager=True, the plain torch code; not eager: the engine's fast paths where "
          "they apply; x HF = HF's wall time / this run's)")


# ------------------------------------------------------------------------ main
def parse_args(argv: list[str]):
    parser = argparse.ArgumentParser(prog="microvllm bench throughput --workload moe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="moe", choices=["moe"])
    parser.add_argument("--model", default=None,
                        help="an existing mixture-of-experts folder (default: a random Qwen3-MoE, see above)")
    parser.add_argument("--quick", action="store_true",
                        help="a small version for CI: 8 experts, hidden 128, 2 layers, 4 short requests")
    parser.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=_positive,
                        help="requests (16; quick: 4)")
    parser.add_argument("--prompt-lens", type=_range, metavar="MIN-MAX", help="64-128 (quick: 16-32)")
    parser.add_argument("--output-lens", type=_range, metavar="MIN-MAX", help="32-64 (quick: 8-12)")
    parser.add_argument("--layer-rows", type=lambda s: [int(x) for x in s.split(",") if x], metavar="T1,T2",
                        help="rows of the one-layer timing (16,512; quick: 4,64)")
    parser.add_argument("--repeat", type=_positive, help="one-layer timings per step, median (5; quick: 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="do not run Hugging Face")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="microvllm-moe-") as folder:
            return _run(args, folder)
    finally:
        torch.set_num_threads(threads)


def _run(args, folder: str) -> int:
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.model is None:
        from microvllm.models.tiny import make_tiny_model

        overrides = QUICK_MODEL if args.quick else MODEL
        model_path = make_tiny_model(Path(folder) / "qwen3_moe", "qwen3_moe", seed=args.seed,
                                     tokenizer=False, **overrides)
    else:
        model_path = Path(args.model).expanduser()
    config = AutoConfig.from_pretrained(model_path)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        raise ValueError(f"{model_path} is not a mixture of experts (no num_experts in its config.json): "
                         "--workload moe needs one; drop --model to use a random Qwen3-MoE")
    total, active = _param_counts(model_path)
    print(f"microvllm bench throughput --workload moe: {model_path.name}, {experts} experts, top-"
          f"{config.num_experts_per_tok}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"vocab {config.vocab_size}; {total / 1e6:.1f}M params, {active / 1e6:.1f}M active per token; "
          f"float32, torch {torch.__version__} on {torch.get_num_threads()} threads")
    print(f"cpu: {cpu_description()}")
    print()
    with moe_impl(None):
        llm = _llm(model_path, args, enforce_eager=True)
        bench_layer(llm, args.layer_rows, args.repeat, args.seed)
    del llm
    gc.collect()
    bench_engine(args, model_path, config.vocab_size)
    return 0


def _param_counts(model_path: Path) -> tuple[int, int]:
    """(all parameters, those one token uses: every non-expert tensor + top_k of E experts)."""
    import json

    from safetensors import safe_open

    config = json.loads((model_path / "config.json").read_text())
    experts = config.get("num_experts") or config.get("num_local_experts")
    top_k = config["num_experts_per_tok"]
    total = expert = 0
    files = sorted(model_path.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                n = f.get_slice(name).get_shape()
                count = 1
                for d in n:
                    count *= d
                total += count
                if ".experts." in name:
                    expert += count
    return total, total - expert + expert * top_k // experts


if __name__ == "__main__":
    sys.exit(main())
