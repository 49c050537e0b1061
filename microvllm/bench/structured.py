"""``microvllm bench structured``: what a grammar costs. The same chat prompts with and
without a JSON schema, side by side in one run, at each batch size::

    batch   plain tok/s   schema tok/s   ratio   mask ms/step   valid JSON
      1        ...            ...          ...       ...          n / n

The constrained run's outputs end when their JSON is complete; each side's tok/s is its
own generated tokens over its own wall time (decode-bound either way). ``mask ms/step``
is the time the grammars took to fill the step's bitmask (``StructuredOutputManager``).
"""

from __future__ import annotations

import argparse
import json
import time

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
    "population_millions": {"type": "number"},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 32},
                                                              "maxItems": 3}},
    "required": ["city", "country", "population_millions", "landmarks"], "additionalProperties": False}
CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Seoul", "Rome", "Dakar", "Hanoi",
          "Berlin", "Nairobi", "Toronto", "Madrid"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="microvllm bench structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--backend", default="auto", help="structured_outputs_backend: auto, xgrammar, course")
    parser.add_argument("--enforce-eager", action="store_true")
    return parser


def main(argv: list[str]) -> int:
    from microvllm import LLM, SamplingParams
    from microvllm.sampling_params import StructuredOutputsParams

    args = build_parser().parse_args(argv)
    llm = LLM(args.model, structured_outputs_backend=args.backend, enforce_eager=args.enforce_eager,
              max_num_seqs=max(args.batch_sizes))
    manager = llm.engine.structured_output_manager
    print(f"{'batch':>5} {'plain tok/s':>12} {'schema tok/s':>13} {'ratio':>6} {'mask ms/step':>13} {'valid JSON':>11}")
    for batch in args.batch_sizes:
        conversations = [[{"role": "user", "content": f"Describe {CITIES[i % len(CITIES)]} as JSON."}]
                         for i in range(batch)]
        plain = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                     structured_outputs=StructuredOutputsParams(json=SCHEMA))
        for params in (plain, constrained):   # warm: kernels, the grammar's compile, first masks
            llm.chat(conversations, params, use_tqdm=False)
        rates = {}
        for name, params in (("plain", plain), ("schema", constrained)):
            before = (manager.mask_seconds_total, manager.num_mask_steps)
            start = time.perf_counter()
            outs = llm.chat(conversations, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates[name] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
            if name == "schema":
                steps = manager.num_mask_steps - before[1]
                mask_ms = 1000 * (manager.mask_seconds_total - before[0]) / max(steps, 1)
                valid = sum(_is_json(o.outputs[0].text) for o in outs)
        print(f"{batch:>5} {rates['plain']:>12.1f} {rates['schema']:>13.1f} {rates['schema'] / rates['plain']:>6.2f} "
              f"{mask_ms:>13.2f} {valid:>6} / {batch}")
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False
