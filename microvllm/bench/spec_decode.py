"""``microvllm bench throughput --speculative-config '<json>'``: decoding with and without
drafts, side by side in one process, on the workloads where speculation wins and loses.

    workload   copy   the model repeats or lightly edits a text it was given (quoting,
                      editing code, summarising with citations): drafts are easy to guess
               chat   open questions: new text, drafts rarely right
    batch      1      one request at a time: decode is memory-bound, the k + 1 checked
                      tokens cost about one token's weights
               8      8 requests at once: the step is less memory-bound, drafts cost more

For each (workload, batch) the plain engine and the speculative one run in turn,
``--repeat`` times; the best run of each is reported (tok/s = generated tokens / wall
time), with each request's latency (arrival to last token) and the acceptance. Greedy
outputs are compared: they must be identical.
"""

from __future__ import annotations

import time
from pathlib import Path

COPY_TEXTS = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
    "step. All that glitters is not gold, and the early bird catches the worm.",
    "To make a cup of tea, boil fresh water, warm the pot, add one spoon of leaves per cup, pour the "
    "water over the leaves and wait four minutes before you pour.",
    "def add(a, b):\n    return a + b\n\ndef multiply(a, b):\n    return a * b\n\nprint(add(2, 3), multiply(4, 5))",
    "Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of Spain. "
    "Rome is the capital of Italy. Lisbon is the capital of Portugal.",
    "The meeting is moved from Tuesday at ten to Thursday at two. Please bring the quarterly report, "
    "the budget draft and your questions for the planning team.",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air pressure is "
    "lower, so water boils at a lower temperature and cooking takes longer.",
    "Dear Anna, thank you for your letter. I am glad that the garden is growing well and that the "
    "tomatoes are finally red. I will visit you in August. Best wishes, Tom.",
    "Step one: open the box. Step two: take out the parts. Step three: read the manual. Step four: "
    "attach the legs to the table top. Step five: tighten every screw.",
)
CHAT_QUESTIONS = (
    "Write a short story about a robot who learns to paint.",
    "Why is the sky blue? Explain it to a child.",
    "Give me three ideas for a birthday party in winter.",
    "What should I think about before adopting a dog?",
    "Describe a walk through a forest in autumn.",
    "How do airplanes stay in the air?",
    "Write a poem about the sea.",
    "What are good habits for learning a new language?",
)


def workloads() -> dict[str, list[list[dict]]]:
    """Chat conversations per workload (8 each)."""
    return {
        "copy": [[{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{text}"}]
                 for text in COPY_TEXTS],
        "chat": [[{"role": "user", "content": question}] for question in CHAT_QUESTIONS],
    }


def run_batch(llm, prompts: list[str], params) -> tuple[float, list[float], list[list[int]]]:
    """All prompts at once through the engine's step loop: (wall seconds, each one's
    latency in seconds, token ids)."""
    engine = llm.engine
    ids = [f"bench-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    latency: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                latency[out.request_id] = time.perf_counter() - start
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return time.perf_counter() - start, [latency[i] for i in ids], [tokens[i] for i in ids]


def bench_speculative(args, model_path: Path) -> None:
    from microvllm import LLM, SamplingParams

    spec = args.speculative_config
    params = SamplingParams(temperature=0.0, max_tokens=args.spec_output_len)
    print(f"speculative decoding: {spec}")
    print(f"greedy, {args.spec_output_len} tokens per request at most, best of {args.repeat} runs each, "
          "plain and speculative in turn")
    common = dict(dtype=args.dtype, seed=args.seed, enforce_eager=args.enforce_eager)
    plain = LLM(str(model_path), **common)
    speculative = LLM(str(model_path), speculative_config=spec, **common)
    for llm in (plain, speculative):   # warm up: first calls build kernels and caches
        run_batch(llm, [plain.tokenizer.chat_prompt(c, True) for c in workloads()["copy"][:2]], params)
    header = (f"{'workload':9s} {'batch':>5s} {'plain tok/s':>12s} {'spec tok/s':>11s} {'ratio':>6s} "
              f"{'latency plain':>14s} {'latency spec':>13s} {'accepted':>9s} {'tokens/step':>12s} identical")
    print(header)
    print("-" * len(header))
    for name, conversations in workloads().items():
        prompts = [plain.tokenizer.chat_prompt(c, True) for c in conversations]
        for batch in args.spec_batches:
            groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
            best: dict[str, tuple[float, list[float], list[list[int]]]] = {}
            stats_before = _copy_stats(speculative)
            for _ in range(args.repeat):
                for label, llm in (("plain", plain), ("spec", speculative)):
                    wall, latencies, outputs, = 0.0, [], []
                    for group in groups:
                        seconds, lat, out = run_batch(llm, group, params)
                        wall, latencies, outputs = wall + seconds, latencies + lat, outputs + out
                    rate = sum(map(len, outputs)) / wall
                    if label not in best or rate > sum(map(len, best[label][2])) / best[label][0]:
                        best[label] = (wall, latencies, outputs)
            stats = _stats_since(speculative, stats_before)
            (wall_p, lat_p, out_p), (wall_s, lat_s, out_s) = best["plain"], best["spec"]
            rate_p, rate_s = sum(map(len, out_p)) / wall_p, sum(map(len, out_s)) / wall_s
            same = sum(a == b for a, b in zip(out_p, out_s))
            print(f"{name:9s} {batch:5d} {rate_p:12.1f} {rate_s:11.1f} {rate_s / rate_p:5.2f}x "
                  f"{_mean(lat_p) * 1e3:11.0f} ms {_mean(lat_s) * 1e3:10.0f} ms "
                  f"{stats['rate']:8.0%} {stats['length']:12.2f} {same}/{len(out_p)}")
    print("\nratio = spec / plain tok/s; latency = mean over requests of arrival to last token; "
          "accepted = accepted drafts / drafts checked; tokens/step = tokens a request with drafts "
          "gains per step (1 + accepted drafts)")


def _copy_stats(llm) -> tuple[int, int, int]:
    s = llm.engine.scheduler.spec_decoding_stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def _stats_since(llm, before: tuple[int, int, int]) -> dict[str, float]:
    drafts, draft_tokens, accepted = (a - b for a, b in zip(_copy_stats(llm), before))
    return {"rate": accepted / draft_tokens if draft_tokens else 0.0,
            "length": 1 + accepted / drafts if drafts else 1.0}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
