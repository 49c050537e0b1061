"""``microvllm bench structured``: what a grammar costs. The same chat prompts with and
without a JSON schema, and with strict tools (the Hermes structural tag of two tools, as
``tool_choice="auto"`` with ``strict`` tools uses: free text until ``<tool_call>``), side
by side in one run, at each batch size::

    batch  constraint    tok/s   vs plain   mask ms/step   valid JSON
      1    plain          ...
      1    schema         ...      ...          ...          n / n
      1    strict tools   ...      ...          ...

The schema run's outputs end when their JSON is complete; each run's tok/s is its own
generated tokens over its own wall time (decode-bound either way). ``mask ms/step`` is
the time the grammars took to fill the step's bitmask (``StructuredOutputManager``).
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
    from microvllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    args = build_parser().parse_args(argv)
    llm = LLM(args.model, structured_outputs_backend=args.backend, enforce_eager=args.enforce_eager,
              max_num_seqs=max(args.batch_sizes))
    manager = llm.engine.structured_output_manager
    strict_tools = Hermes2ProToolParser.structural_tag({
        "get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "get_time": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}})
    constraints = {"plain": None, "schema": StructuredOutputsParams(json=SCHEMA),
                   "strict tools": StructuredOutputsParams(structural_tag=strict_tools)}
    print(f"{'batch':>5}  {'constraint':<13} {'tok/s':>7} {'vs plain':>9} {'mask ms/step':>13} {'valid JSON':>11}")
    for batch in args.batch_sizes:
        conversations = [[{"role": "user", "content": f"Describe {CITIES[i % len(CITIES)]} as JSON."}]
                         for i in range(batch)]
        params = {name: SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=constraint)
                  for name, constraint in constraints.items()}
        for each in params.values():   # warm: kernels, the grammars' compiles, first masks
            llm.chat(conversations, each, use_tqdm=False)
        rates = {}
        for name, each in params.items():
            before = (manager.mask_seconds_total, manager.num_mask_steps)
            start = time.perf_counter()
            outs = llm.chat(conversations, each, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates[name] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
            line = f"{batch:>5}  {name:<13} {rates[name]:>7.1f}"
            if name != "plain":
                steps = manager.num_mask_steps - before[1]
                mask_ms = 1000 * (manager.mask_seconds_total - before[0]) / max(steps, 1)
                line += f" {rates[name] / rates['plain']:>9.2f} {mask_ms:>13.2f}"
            if name == "schema":
                line += f" {sum(_is_json(o.outputs[0].text) for o in outs):>6} / {batch}"
            print(line)
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False
