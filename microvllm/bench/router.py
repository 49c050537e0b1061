"""``microvllm bench router``: routing policies side by side, on two real replicas.

    python -m microvllm bench router [--quick] [--model tiny|FOLDER] [--num-prefixes 8]
                                     [--num-requests 64] [--request-rate 2] [--policies ...]

For each policy, in one run on 127.0.0.1::

    client (Poisson arrivals, streaming) --> front --+--> microvllm serve (replica 0)
                                                      +--> microvllm serve (replica 1)

    front = vllm-router --policy round_robin | power_of_two | cache_aware | kv_aware
          | the course router over HTTP (router/http_proxy.py): round_robin | least_loaded
            | prefix_aware | kv_events

The workload is multi-tenant: ``--num-prefixes`` system prompts (300-600 tokens each),
each shared by many short questions; every request is one prefix (chosen at random,
seeded) plus a question of its own. Each replica gets ``--num-kv-blocks`` sized to hold
about half of the prefixes, so all of them overflow one replica's cache but fit in two:
a policy that sends each prefix to one replica keeps it cached, one that spreads every
prefix over both evicts and recomputes. The two replicas start once; before each policy
their prefix caches are emptied (``POST /reset_prefix_cache``, vLLM's development endpoint:
``VLLM_SERVER_DEV_MODE=1``) and only the front is started anew, so every policy starts
cold. Each replica runs with OMP_NUM_THREADS=1 and publishes its KV events
(``tcp://127.0.0.1:PORT``) for the two policies that read them.

Per policy: the prefix-cache hit rate (``vllm:prefix_cache_hits`` / ``queries`` deltas on
the replicas' ``/metrics``), TTFT p50 / p99 (client-side, to the first streamed chunk),
requests/s and output tokens/s, and requests per replica (``vllm:request_success``).
Timings on a shared machine are noisy; hit rates and placement are not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from microvllm.testing import (
    free_port,
    free_ports,
    start_process,
    stop_process,
    vllm_router_binary,
    wait_for,
    wait_healthy,
)

VLLM_ROUTER_POLICIES = ("round_robin", "power_of_two", "cache_aware", "kv_aware")
COURSE_POLICIES = ("round_robin", "least_loaded", "prefix_aware", "kv_events")
ALL_POLICIES = tuple(f"vllm-router:{p}" for p in VLLM_ROUTER_POLICIES) + tuple(f"course:{p}" for p in COURSE_POLICIES)
BLOCK_SIZE = 16
WORDS = ("cache", "block", "token", "replica", "router", "prefix", "queue", "batch", "tensor", "kernel", "memory",
         "request", "latency", "budget", "schedule", "attention", "policy", "tenant", "session", "answer", "stream",
         "engine", "worker", "model", "layer", "weight", "page", "table", "hash", "event", "load", "system")


# ------------------------------------------------------------------ processes
def counters(url: str) -> dict[str, float]:
    """The sums of the ``vllm:`` counters this bench reads from one replica's /metrics."""
    import httpx

    names = ("prefix_cache_hits_total", "prefix_cache_queries_total", "request_success_total")
    values = dict.fromkeys(names, 0.0)
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in names:
            if line.startswith(f"vllm:{name}{{") or line.startswith(f"vllm:{name} "):
                values[name] += float(line.rsplit(" ", 1)[1])
    return values


# ------------------------------------------------------------------ the workload
@dataclass
class Workload:
    prefixes: list[str]
    prefix_tokens: list[int]
    prompts: list[str]          # in arrival order
    prefix_of: list[int]        # which prefix each prompt shares
    gaps: list[float]           # seconds before each arrival

    @property
    def prefix_blocks(self) -> int:
        return sum(math.ceil(n / BLOCK_SIZE) for n in self.prefix_tokens)


def make_workload(tokenizer, num_prefixes: int, min_tokens: int, max_tokens: int, num_requests: int,
                  request_rate: float, seed: int) -> Workload:
    """``num_prefixes`` system prompts of ``min_tokens``..``max_tokens`` tokens; ``num_requests``
    prompts, each a random prefix + its own question; Poisson gaps at ``request_rate``."""
    from microvllm.bench.serve import poisson_gaps

    rng = random.Random(seed)
    prefixes, lengths = [], []
    for k in range(num_prefixes):
        target = rng.randint(min_tokens, max_tokens)
        sentences = [f"You are assistant number {k} of tenant {k}."]
        while True:
            text = " ".join(sentences)
            length = len(tokenizer.encode(text))
            if length >= target:
                break
            a, b, c = rng.sample(WORDS, 3)
            sentences.append(f"Rule {k}.{len(sentences)}: the {a} comes before the {b} unless the {c} is full.")
        prefixes.append(text)
        lengths.append(length)
    prefix_of = [rng.randrange(num_prefixes) for _ in range(num_requests)]
    prompts = [f"{prefixes[k]}\nQuestion {i}: why does the {rng.choice(WORDS)} need a {rng.choice(WORDS)}?\nAnswer:"
               for i, k in enumerate(prefix_of)]
    return Workload(prefixes, lengths, prompts, prefix_of, poisson_gaps(num_requests, request_rate, seed))


# ------------------------------------------------------------------ one policy
@dataclass
class PolicyResult:
    front: str
    policy: str
    requests: int = 0
    completed: int = 0
    hit_rate: float = 0.0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    requests_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    per_replica: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def name(self) -> str:
        return f"{self.front}:{self.policy}"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


async def drive(url: str, model: str, workload: Workload, max_tokens: int) -> tuple[list, float]:
    """Send the workload with its arrival gaps (streaming); the results and the wall time."""
    import httpx

    from microvllm.bench.serve import send_one

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start_time = time.perf_counter()
        tasks = []
        for prompt, gap in zip(workload.prompts, workload.gaps):
            await asyncio.sleep(gap)
            payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(send_one(client, url + "/v1/completions", payload)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start_time


def replica_command(model: str, port: int, events_port: int, args) -> list[str]:
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}"}
    return [sys.executable, "-m", "microvllm", "serve", model, "--port", str(port), "--uvicorn-log-level", "warning",
            "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--num-kv-blocks", str(args.num_kv_blocks),
            "--block-size", str(BLOCK_SIZE), "--shutdown-timeout", "1", "--kv-events-config", json.dumps(events)]


def front_command(front: str, policy: str, port: int, replicas: list[str], events: list[str], model: str,
                  args) -> list[str]:
    if front == "vllm-router":
        router = vllm_router_binary()
        assert router is not None
        command = [router, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls",
                   *replicas, "--log-level", "warning", "--prometheus-port", str(free_port())]
        if policy == "kv_aware":
            for url, endpoint in zip(replicas, events):
                command += ["--kv-event-source", f"{url}={endpoint}"]
            command += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", model]
        return command
    command = [sys.executable, "-m", "microvllm.router.http_proxy", "--port", str(port), "--policy", policy,
               "--model", model, "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(args.num_kv_blocks - 1)]
    for url, endpoint in zip(replicas, events):
        command += ["--replica", url] + (["--kv-events", endpoint] if policy == "kv_events" else [])
    return command


@dataclass
class Replicas:
    """The two replicas every policy is measured on (started once)."""

    urls: list[str]
    events: list[str]                 # their KV event endpoints
    processes: list[subprocess.Popen]

    def reset_prefix_caches(self, timeout: float = 60.0) -> None:
        """Empty both prefix caches (a 409 while a block is still in use: asked again)."""
        import httpx

        for url in self.urls:
            wait_for(lambda url=url: httpx.post(url + "/reset_prefix_cache", timeout=30).status_code == 200,
                     timeout, f"{url} to empty its prefix cache", interval=0.5)

    def stop(self) -> None:
        for process in self.processes:
            stop_process(process, term_timeout=10)


def start_replicas(model: str, args, logs: Path) -> Replicas:
    chosen = free_ports(4)   # taken together: one call after another may repeat a port
    ports, event_ports = chosen[:2], chosen[2:]
    replicas = Replicas([f"http://127.0.0.1:{p}" for p in ports], [f"tcp://127.0.0.1:{p}" for p in event_ports], [])
    replica_logs = [logs / f"replica{i}.log" for i in range(2)]
    try:
        for i in range(2):
            replicas.processes.append(start_process(replica_command(model, ports[i], event_ports[i], args),
                                                    replica_logs[i], env={"VLLM_SERVER_DEV_MODE": "1"}))
        for i, url in enumerate(replicas.urls):
            wait_healthy(url, replicas.processes[i], replica_logs[i], args.startup_timeout)
    except BaseException:
        replicas.stop()
        raise
    return replicas


def run_policy(name: str, model: str, workload: Workload, args, logs: Path, replicas: Replicas) -> PolicyResult:
    """One policy's run; run again once if its front could not bind its port (another
    program took it between our choice and its bind: a race no choice of port avoids)."""
    result = run_policy_once(name, model, workload, args, logs, replicas)
    if "Address already in use" in result.error:
        result = run_policy_once(name, model, workload, args, logs, replicas)
    return result


def run_policy_once(name: str, model: str, workload: Workload, args, logs: Path, replicas: Replicas) -> PolicyResult:
    front, _, policy = name.partition(":")
    result = PolicyResult(front, policy, requests=len(workload.prompts))
    tag = name.replace(":", "_")
    process = None
    try:
        replicas.reset_prefix_caches()   # every policy starts cold
        port = free_port()
        process = start_process(front_command(front, policy, port, replicas.urls, replicas.events, model, args),
                                logs / f"{tag}.log")
        wait_healthy(f"http://127.0.0.1:{port}", process, logs / f"{tag}.log", 60)
        time.sleep(0.5)   # the KV event subscribers connect (a PUB drops what it sends before)
        before = [counters(url) for url in replicas.urls]
        results, wall = asyncio.run(drive(f"http://127.0.0.1:{port}", model, workload, args.max_tokens))
        time.sleep(0.2)
        after = [counters(url) for url in replicas.urls]
        delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
        ok = [r for r in results if r.ok]
        errors = sorted({r.error for r in results if not r.ok})
        queries = sum(d["prefix_cache_queries_total"] for d in delta)
        result.completed = len(ok)
        result.hit_rate = sum(d["prefix_cache_hits_total"] for d in delta) / queries if queries else 0.0
        result.ttft_p50_ms = percentile([r.ttft * 1000 for r in ok], 50)
        result.ttft_p99_ms = percentile([r.ttft * 1000 for r in ok], 99)
        result.requests_per_s = len(ok) / wall
        result.output_tokens_per_s = sum(r.output_tokens for r in ok) / wall
        result.per_replica = [int(d["request_success_total"]) for d in delta]
        result.error = "; ".join(errors)[:300]
        if policy == "kv_events":   # the proxy must have heard the replicas, or it routed blind
            import httpx
            heard = httpx.get(f"http://127.0.0.1:{port}/router/stats", timeout=10).json()["kv_events"]
            if not any(heard):
                result.error = (result.error + f"; KV events received per replica: {heard}").lstrip("; ")
    except Exception as error:  # noqa: BLE001 - one policy failing is reported, the others still run
        result.error = f"{type(error).__name__}: {error}"[:500]
    finally:
        if process is not None:
            stop_process(process, term_timeout=10)
    return result


# ------------------------------------------------------------------ the report
def table(results: list[PolicyResult]) -> str:
    lines = [f"{'front':<12} {'policy':<13} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'req/s':>6} "
             f"{'out tok/s':>9} {'per replica':>12} {'completed':>9}",
             f"{'':<12} {'':<13} {'':>8} {'(ms)':>9} {'(ms)':>9}"]
    for r in results:
        replicas = "/".join(str(n) for n in r.per_replica) or "-"
        lines.append(f"{r.front:<12} {r.policy:<13} {r.hit_rate:>8.1%} {r.ttft_p50_ms:>9.0f} {r.ttft_p99_ms:>9.0f} "
                     f"{r.requests_per_s:>6.2f} {r.output_tokens_per_s:>9.1f} {replicas:>12} "
                     f"{r.completed:>4}/{r.requests:<4}" + (f"  error: {r.error}" if r.error else ""))
    return "\n".join(lines)


def hit_ratio(results: list[PolicyResult], front: str, better: str, base: str = "round_robin") -> float | None:
    rates = {r.policy: r.hit_rate for r in results if r.front == front and not r.error}
    if better in rates and rates.get(base):
        return rates[better] / rates[base]
    return None


def resolve_model(choice: str | None, scratch: Path) -> str:
    if choice == "tiny":
        from microvllm.models.tiny import make_tiny_model
        return str(make_tiny_model(scratch / "tiny-llama", "llama", seed=3))
    if choice:
        return choice
    from microvllm.models.default_model import default_model_path
    return str(default_model_path())


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="microvllm bench router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a small run on a tiny random model (structure, not figures)")
    parser.add_argument("--model", default=None, help="'tiny', a model folder, or (default) the embedded model")
    parser.add_argument("--policies", nargs="+", default=list(ALL_POLICIES), choices=ALL_POLICIES)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, nargs=2, default=(300, 600), metavar=("MIN", "MAX"))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=2.0, help="requests/s (Poisson); inf: a burst")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="per replica (default: half of the prefixes' blocks, + the null block)")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", default=None, help="folder for the processes' logs (default: a temporary one)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.model = args.model or "tiny"
        args.num_prefixes, args.prefix_tokens = min(args.num_prefixes, 4), (60, 120)
        args.num_requests, args.request_rate, args.max_tokens = min(args.num_requests, 12), 8.0, 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if vllm_router_binary() is None:
        skipped = [p for p in args.policies if p.startswith("vllm-router:")]
        if skipped:
            print(f"vllm-router is not installed (pip install vllm-router): leaving out {', '.join(skipped)}")
        args.policies = [p for p in args.policies if not p.startswith("vllm-router:")]
    with tempfile.TemporaryDirectory(prefix="bench-router-") as scratch:
        logs = Path(args.logs) if args.logs else Path(scratch)
        logs.mkdir(parents=True, exist_ok=True)
        model = resolve_model(args.model, Path(scratch))
        from microvllm.tokenizer import Tokenizer

        low, high = args.prefix_tokens
        workload = make_workload(Tokenizer.from_pretrained(model), args.num_prefixes, low, high,
                                 args.num_requests, args.request_rate, args.seed)
        if args.num_kv_blocks is None:   # half of the prefixes' blocks, + the null block
            args.num_kv_blocks = math.ceil(workload.prefix_blocks / 2) + 1
        print(f"model {model}\n{args.num_prefixes} prefixes of {min(workload.prefix_tokens)}-"
              f"{max(workload.prefix_tokens)} tokens ({workload.prefix_blocks} blocks in all), "
              f"{args.num_requests} requests at {args.request_rate}/s, {args.max_tokens} output tokens each; "
              f"2 replicas x {args.num_kv_blocks} KV blocks", flush=True)
        results = []
        replicas = start_replicas(model, args, logs)
        try:
            for name in args.policies:
                started = time.monotonic()
                results.append(run_policy(name, model, workload, args, logs, replicas))
                print(f"  {name}: {time.monotonic() - started:.0f} s", flush=True)
        finally:
            replicas.stop()
    print(table(results))
    for front, better in (("vllm-router", "cache_aware"), ("vllm-router", "kv_aware"), ("course", "prefix_aware"),
                          ("course", "kv_events")):
        ratio = hit_ratio(results, front, better)
        if ratio is not None:
            print(f"{front} {better} / round_robin hit rate: {ratio:.2f}x")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps([vars(r) for r in results], indent=2))
    return 0 if all(r.completed == r.requests and not r.error for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
