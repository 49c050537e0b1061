"""``microvllm bench serve``: load a running server with requests that arrive over time
(vLLM: ``vllm bench serve``, ``benchmarks/serve.py``).

    microvllm serve --port 8000 &                           # in one shell
    microvllm bench serve --port 8000 --num-prompts 64 --request-rate 4 --output-json out.json

Arrivals are a Poisson process: the gaps between requests are exponential with mean
1 / request_rate, so requests bunch up and spread out as real traffic does
(``--request-rate inf``: all at once, a burst). Each request streams, so the client
sees every token arrive::

    sent ──── TTFT ────> tok ─ ITL ─> tok ─ ITL ─> tok ... tok (last)
    |<──────────────────────── latency ──────────────────────>|
    TPOT = (latency - TTFT) / (output tokens - 1)    time per output token after the first

Prompts are random token ids (``--input-len`` of them, ids 100..499, valid in any
vocabulary of 512 or more), so every prompt is different and the prefix cache does
not help; ``ignore_eos`` makes each request generate exactly ``--output-len`` tokens.
``--dataset-name copy`` / ``chat`` send chat requests instead (``/v1/chat/completions``,
greedy, up to ``--output-len`` tokens): asking the model to repeat a given text, or open
questions — the workloads where speculative decoding wins and loses. Speculative decoding
is the server's setting (``microvllm serve --speculative-config '<json>'``); when the
server does it, the report adds its acceptance over the run, read from ``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def poisson_gaps(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (0 for a burst)."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in range(num)]


def random_prompts(num: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 500) for _ in range(input_len)] for _ in range(num)]


def chat_requests(dataset: str, num: int) -> list[list[dict]]:
    """``num`` conversations of the copy or chat workload (``bench/spec_decode.py``), cycled."""
    from microvllm.bench.spec_decode import workloads

    conversations = workloads()[dataset]
    return [conversations[i % len(conversations)] for i in range(num)]


async def send_one(client, url: str, payload: dict) -> RequestResult:
    """Stream one completion; time the first token and every later one."""
    result = RequestResult(prompt_len=len(payload.get("prompt", ())))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "the stream ended without tokens"
    except Exception as error:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(error).__name__}: {error}"
    return result


async def benchmark(base_url: str, model: str, prompts: list, output_len: int,
                    request_rate: float, seed: int = 0, max_concurrency: int | None = None,
                    timeout: float = 600.0) -> dict:
    """Send ``prompts`` (token id lists, or chat conversations) with Poisson arrivals;
    return the summary (and per-request lists)."""
    import httpx

    chat = bool(prompts) and isinstance(prompts[0][0], dict)
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    gaps = poisson_gaps(len(prompts), request_rate, seed)

    async def limited(client, payload):
        if limit is None:
            return await send_one(client, url, payload)
        async with limit:
            return await send_one(client, url, payload)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            await asyncio.sleep(gap)
            payload = {"model": model, "max_tokens": output_len, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}}
            payload.update({"messages": prompt} if chat else {"prompt": prompt, "ignore_eos": True})
            tasks.append(asyncio.create_task(limited(client, payload)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, request_rate)


def summarize(results: list[RequestResult], duration: float, request_rate: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1000 for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1]
    itls = [gap * 1000 for r in ok for gap in r.itl]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    summary = {"request_rate": "inf" if math.isinf(request_rate) else request_rate,
               "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
               "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
               "request_throughput": len(ok) / duration,
               "output_throughput": output_tokens / duration,
               "total_token_throughput": (input_tokens + output_tokens) / duration}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        summary[f"mean_{name}_ms"] = sum(values) / len(values) if values else 0.0
        summary[f"median_{name}_ms"] = percentile(values, 50)
        summary[f"p99_{name}_ms"] = percentile(values, 99)
    summary["errors"] = sorted({r.error for r in results if r.error})[:5]
    summary["ttfts"], summary["itls"] = ttfts, itls
    summary["output_lens"] = [r.output_tokens for r in results]
    return summary


def spec_decode_counters(base_url: str) -> tuple[int, int, int] | None:
    """(drafts, draft tokens, accepted tokens) from the server's ``/metrics``; None when it
    does no speculative decoding (or has no /metrics)."""
    import httpx

    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    values = {}
    for line in text.splitlines():
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if line.startswith(f"vllm:spec_decode_{name}_total{{"):
                values[name] = int(float(line.rsplit(" ", 1)[1]))
    if len(values) < 3:
        return None
    return values["num_drafts"], values["num_draft_tokens"], values["num_accepted_tokens"]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def format_table(s: dict) -> str:
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Request rate configured (RPS):", s["request_rate"]),
            ("Benchmark duration (s):", f"{s['duration']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]
    lines += [f"{name:<40}{value:<10}" for name, value in rows]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency")):
        lines.append("{:-^50}".format(title))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            lines.append(f"{f'{label} {name.upper()} (ms):':<40}{s[f'{stat}_{name}_ms']:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected requests per second > 0 (or inf), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="microvllm bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="the server (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None, help="default: the server's one model (/v1/models)")
    parser.add_argument("--num-prompts", type=_positive_int, default=64)
    # vLLM's spellings (--dataset-name random --random-input-len N) work too.
    parser.add_argument("--dataset-name", choices=["random", "copy", "chat"], default="random",
                        help="where prompts come from: random token sequences; copy (repeat a given "
                             "text) or chat (open questions), sent as chat requests (vLLM's other "
                             "datasets need downloads, which this benchmark never makes)")
    parser.add_argument("--input-len", "--random-input-len", dest="input_len", type=_positive_int, default=32,
                        help="prompt tokens per request")
    parser.add_argument("--output-len", "--random-output-len", dest="output_len", type=_positive_int,
                        default=32, help="tokens generated per request")
    parser.add_argument("--request-rate", type=_rate, default=float("inf"),
                        help="requests per second (Poisson arrivals); inf sends them all at once")
    parser.add_argument("--max-concurrency", type=_positive_int, default=None,
                        help="at most this many requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--output-json", default=None, help="write the results to this file")
    return parser


def main(argv: list[str]) -> int:
    import httpx

    args = build_parser().parse_args(argv)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    model = args.model
    if model is None:
        model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    prompts: list = (random_prompts(args.num_prompts, args.input_len, args.seed) if args.dataset_name == "random"
                     else chat_requests(args.dataset_name, args.num_prompts))
    before = spec_decode_counters(base_url)
    summary = asyncio.run(benchmark(base_url, model, prompts, args.output_len, args.request_rate,
                                    args.seed, args.max_concurrency, args.timeout))
    after = spec_decode_counters(base_url)
    if before is not None and after is not None:
        drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before))
        summary["spec_decode_acceptance_rate"] = accepted / draft_tokens if draft_tokens else 0.0
        summary["spec_decode_mean_acceptance_length"] = 1 + accepted / drafts if drafts else 1.0
    print(format_table(summary))
    if "spec_decode_acceptance_rate" in summary:
        print(f"speculative decoding on the server: {summary['spec_decode_acceptance_rate']:.0%} of drafts "
              f"accepted, {summary['spec_decode_mean_acceptance_length']:.2f} tokens per step with drafts")
    if summary["errors"]:
        print("errors:", *summary["errors"], sep="\n  ", file=sys.stderr)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({**summary, "model": model, "num_prompts": args.num_prompts, "input_len": args.input_len,
                       "output_len": args.output_len, "args": vars(args)}, f, indent=2, default=str)
    return 0 if summary["failed"] == 0 else 1

