"""``microvllm bench throughput --workload lora``: what serving LoRA adapters costs, side by
side in one run, at each batch size::

    batch  run                      tok/s   vs base
      1    base, LoRA off           ...
      1    base, LoRA on            ...     ...     (enable_lora=True, no adapter asked for)
      1    4 adapters               ...     ...     (request i runs adapter i % 4)
     32    ...

"LoRA on" alone already costs something: the wrapped layers run as written (the CPU decode
fast path and CUDA graphs are off with LoRA), and every step sets the token -> slot mapping.
The adapters' own cost is the two small matmuls per wrapped layer, per token, of the batched
gather (``lora/ops/torch_ops.py``).

The adapters are made here, with peft, on the model's own weights (random A and B of rank
``--rank`` on every projection), so nothing is downloaded: peft is needed
(``pip install peft``). Every request is greedy with ``ignore_eos`` and ``--max-tokens``
tokens, so each run generates the same count; each run is timed ``--rounds`` times, the runs
alternating, and the best round is printed (a shared machine only ever slows a run down).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

PROMPT = "Describe the city of Paris in one sentence:"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="microvllm bench throughput --workload lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="lora", choices=["lora"])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--adapters", type=int, default=4, help="how many adapters the requests spread over")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    return parser


def make_adapters(model_folder: Path, count: int, rank: int, into: Path) -> list[Path]:
    """``count`` peft adapters of random A and B (``init_lora_weights=False``: B is not
    zero, so each one changes the answer), saved as peft saves them."""
    try:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ValueError("bench throughput --workload lora makes its adapters with peft: pip install peft") from None
    folders = []
    for index in range(count):
        base = AutoModelForCausalLM.from_pretrained(str(model_folder), dtype=torch.float32)
        torch.manual_seed(index + 1)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                init_lora_weights=False))
        folder = into / f"adapter_{index}"
        model.save_pretrained(str(folder))
        folders.append(folder)
    return folders


def main(argv: list[str]) -> int:
    from microvllm import LLM, SamplingParams
    from microvllm.lora.request import LoRARequest
    from microvllm.models.default_model import default_model_path

    args = build_parser().parse_args(argv)
    model = Path(args.model) if args.model else default_model_path()
    with tempfile.TemporaryDirectory(prefix="microvllm-bench-lora-") as scratch:
        adapters = [LoRARequest(f"adapter{i}", i + 1, str(folder))
                    for i, folder in enumerate(make_adapters(model, args.adapters, args.rank, Path(scratch)))]
        max_seqs = max(args.batch_sizes)
        engines = {"base, LoRA off": LLM(str(model), max_num_seqs=max_seqs),
                   "with LoRA": LLM(str(model), max_num_seqs=max_seqs, enable_lora=True,
                                    max_loras=args.adapters, max_lora_rank=args.rank)}
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        print(f"{'batch':>5}  {'run':<22} {'tok/s':>8} {'vs base':>8}")
        for batch in args.batch_sizes:
            runs = {"base, LoRA off": (engines["base, LoRA off"], None),
                    "base, LoRA on": (engines["with LoRA"], None),
                    f"{args.adapters} adapters": (engines["with LoRA"],
                                                  [adapters[i % len(adapters)] for i in range(batch)])}
            best: dict[str, float] = {}
            for round_ in range(args.rounds + 1):   # round 0 warms each run up, untimed
                for name, (llm, loras) in runs.items():
                    start = time.perf_counter()
                    outs = llm.generate([PROMPT] * batch, params, use_tqdm=False, lora_request=loras)
                    rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
                    if round_ > 0:
                        best[name] = max(best.get(name, 0.0), rate)
            base = best["base, LoRA off"]
            for name, rate in best.items():
                ratio = "" if name == "base, LoRA off" else f"{rate / base:>8.2f}"
                print(f"{batch:>5}  {name:<22} {rate:>8.1f} {ratio}")
    return 0
