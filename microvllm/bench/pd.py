"""``microvllm bench pd``: why prefill/decode disaggregation exists, measured. One long
greedy decode stream's inter-token latency while a flood of long prompts arrives::

    colocated       client ──> vllm-router ──> microvllm serve            (core 0)
                                               prefills the flood and decodes the stream
                                               in the same steps: a step that carries a
                                               prefill chunk delays every decode token
    disaggregated   client ──> vllm-router --vllm-pd-disaggregation --kv-connector nixl
                                 ├──> microvllm serve, kv_producer  (prefill, core 1)
                                 └──> microvllm serve, kv_consumer  (decode,  core 0)
                                      reads each prompt's KV blocks over TCP (P2PConnector)
                                      and only decodes

    python -m microvllm bench pd [--quick] [--model tiny|FOLDER] [--stream-tokens 640]
                                 [--num-flood 10] [--flood-tokens 512] [--flood-rate 0.5]

The stream (a short prompt, ``--stream-tokens`` tokens, ``ignore_eos``) starts first; once
it has ``--warmup-tokens`` tokens the flood is sent through the same front
(``--num-flood`` distinct prompts of ``--flood-tokens`` tokens, Poisson arrivals at
``--flood-rate``/s, ``--flood-max-tokens`` tokens each). Client-side, from the streamed
chunks: the stream's gaps between chunks (ITL) before the flood (quiet p50) and while any
flood request was in flight (mean / p50 / p99 / max, and how many: a stalled stream has
fewer), and the flood's TTFT (p50 / p99). The
stream's greedy tokens (``logprobs: 0`` gives each chunk's tokens) must be identical in
both arms.

Pinning (Linux ``taskset``, ``OMP_NUM_THREADS=1`` for every server): the colocated server
on core 0; the decode server on core 0 and the prefill server on core 1; vllm-router and
this client on the last core in both arms (the decode core never shares with them). The
disaggregated arm uses two cores to the colocated arm's one: the figure shows the
interference taken off the decode core, not a per-core efficiency. The colocated server
sits behind vllm-router too (``--worker-urls``), so both arms pay the same proxy hop.
Without ``vllm-router`` (``pip install vllm-router``) the disaggregated arm is skipped
and the colocated server is driven directly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from microvllm.bench.roofline import cpu_description
from microvllm.bench.router import WORDS, percentile, resolve_model
from microvllm.testing import free_port, start_process, stop_process, vllm_router_binary, wait_healthy


# ------------------------------------------------------------------ the pair's command lines
def p2p_flags(role: str, **extra) -> list[str]:
    """``microvllm serve`` flags for one side of the P2PConnector pair (``kv_producer`` or
    ``kv_consumer``), with ``kv_connector_extra_config`` from ``extra``."""
    config = {"kv_connector": "P2PConnector", "kv_role": role, "kv_connector_extra_config": extra}
    return ["--kv-transfer-config", json.dumps(config)]


def pd_router_command(router: str, port: int, prefill_url: str, decode_url: str,
                      log_level: str = "warning") -> list[str]:
    """The real vllm-router in front of the pair, in the NIXL protocol (``kv_transfer_params``)."""
    return [router, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
            "--prefill", prefill_url, "--decode", decode_url, "--kv-connector", "nixl",
            "--policy", "round_robin", "--prometheus-port", str(free_port()), "--log-level", log_level]


# ------------------------------------------------------------------ pinning
def cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return []


def pinned(command: list[str], core: int | None) -> list[str]:
    taskset = shutil.which("taskset")
    return [taskset, "-c", str(core), *command] if core is not None and taskset else command


@dataclass
class Placement:
    """Which core each process runs on (None: not pinned)."""
    colocated: int | None = None
    decode: int | None = None
    prefill: int | None = None
    front: int | None = None   # vllm-router and this client

    @classmethod
    def for_machine(cls, enabled: bool) -> Placement:
        available = cores()
        if not enabled or len(available) < 2 or shutil.which("taskset") is None:
            return cls()
        return cls(colocated=available[0], decode=available[0], prefill=available[1], front=available[-1])

    def describe(self, disaggregated: bool) -> str:
        def core(value: int | None) -> str:
            return "unpinned" if value is None else f"core {value}"
        servers = (f"prefill {core(self.prefill)}, decode {core(self.decode)}" if disaggregated
                   else f"server {core(self.colocated)}")
        return f"{servers}; router + client {core(self.front)}"


# ------------------------------------------------------------------ the workload
def long_prompt(tokenizer, target: int, rng: random.Random, tag: int) -> str:
    """A distinct text of about ``target`` tokens (no prefix shared with the others)."""
    words = [f"Document {tag} begins."]
    while True:
        text = " ".join(words)
        if len(tokenizer.encode(text)) >= target:
            return text
        words += [rng.choice(WORDS) for _ in range(max(2, (target - len(tokenizer.encode(text))) // 4))]


@dataclass
class Workload:
    stream_prompt: str
    warmup: str            # a long prompt of its own (no prefix hit for the flood)
    flood: list[str]
    flood_tokens: list[int]
    gaps: list[float]


def make_workload(tokenizer, args: argparse.Namespace) -> Workload:
    from microvllm.bench.serve import poisson_gaps

    rng = random.Random(args.seed)
    warmup, *flood = [long_prompt(tokenizer, args.flood_tokens, rng, k) for k in range(args.num_flood + 1)]
    return Workload("Tell me a long story about a lighthouse keeper and the ships she saw.", warmup, flood,
                    [len(tokenizer.encode(p)) for p in flood], poisson_gaps(args.num_flood, args.flood_rate, args.seed))


# ------------------------------------------------------------------ one arm
@dataclass
class StreamRecord:
    times: list[float] = field(default_factory=list)   # each chunk that carried tokens
    tokens: list[str] = field(default_factory=list)    # every token's text, in order


async def stream_tokens(client, url: str, payload: dict, record: StreamRecord) -> StreamRecord:
    """Stream one completion with ``logprobs: 0``: every chunk's arrival and its tokens."""
    async with client.stream("POST", url + "/v1/completions", json=payload) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the stream: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):]).get("choices") or []:
                tokens = (choice.get("logprobs") or {}).get("tokens") or []
                if tokens:
                    record.times.append(time.perf_counter())
                    record.tokens.extend(tokens)
    return record


@dataclass
class ArmResult:
    arm: str
    pinned: str = ""
    stream_tokens: int = 0
    itl_quiet_p50_ms: float = 0.0
    itl_flood_samples: int = 0
    itl_flood_mean_ms: float = 0.0
    itl_flood_p50_ms: float = 0.0
    itl_flood_p99_ms: float = 0.0
    itl_flood_max_ms: float = 0.0
    flood_completed: int = 0
    flood_requests: int = 0
    flood_ttft_p50_ms: float = 0.0
    flood_ttft_p99_ms: float = 0.0
    flood_seconds: float = 0.0
    tokens: list[str] = field(default_factory=list)
    error: str = ""


async def drive(url: str, model: str, workload: Workload, args: argparse.Namespace, result: ArmResult) -> None:
    import httpx

    from microvllm.bench.serve import send_one

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        # Warm-up through the front: one long prompt (prefill, and the transfer) and a short one.
        for prompt in (workload.warmup, "Hello there."):
            response = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0})
            if response.status_code != 200:
                raise RuntimeError(f"warm-up: HTTP {response.status_code}: {response.text[:300]}")
        record = StreamRecord()
        stream = asyncio.create_task(stream_tokens(client, url, {
            "model": model, "prompt": workload.stream_prompt, "max_tokens": args.stream_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, "stream": True}, record))
        while len(record.times) < args.warmup_tokens and not stream.done():
            await asyncio.sleep(0.002)
        flood_start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(workload.flood, workload.gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(send_one(client, url + "/v1/completions", {
                "model": model, "prompt": prompt, "max_tokens": args.flood_max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})))
        flood = await asyncio.gather(*tasks)
        flood_end = time.perf_counter()
        await stream
    gaps = [(end, (end - begin) * 1000) for begin, end in zip(record.times, record.times[1:])]
    quiet = [ms for end, ms in gaps if end <= flood_start]
    under = [ms for end, ms in gaps if flood_start < end <= flood_end]
    ok = [r for r in flood if r.ok]
    result.stream_tokens, result.tokens = len(record.tokens), record.tokens
    result.itl_quiet_p50_ms = statistics.median(quiet) if quiet else 0.0
    result.itl_flood_samples = len(under)
    result.itl_flood_mean_ms = statistics.fmean(under) if under else 0.0
    result.itl_flood_p50_ms, result.itl_flood_p99_ms = percentile(under, 50), percentile(under, 99)
    result.itl_flood_max_ms = max(under, default=0.0)
    result.flood_requests, result.flood_completed = len(flood), len(ok)
    result.flood_ttft_p50_ms = percentile([r.ttft * 1000 for r in ok], 50)
    result.flood_ttft_p99_ms = percentile([r.ttft * 1000 for r in ok], 99)
    result.flood_seconds = flood_end - flood_start
    errors = sorted({r.error for r in flood if not r.ok})
    if errors:
        result.error = "; ".join(errors)[:300]


def serve_command(model: str, port: int, args: argparse.Namespace, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "microvllm", "serve", model, "--port", str(port), "--uvicorn-log-level", "warning",
            "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--shutdown-timeout", "1", *flags]


def run_arm(arm: str, model: str, workload: Workload, args: argparse.Namespace, placement: Placement,
            logs: Path) -> ArmResult:
    result = ArmResult(arm, pinned=placement.describe(arm == "disaggregated"))
    router = vllm_router_binary()
    processes: list[subprocess.Popen] = []
    try:
        if arm == "disaggregated":
            assert router is not None
            side_channel = free_port()   # the producer's; the only one the consumer loads from
            sides = {"prefill": (p2p_flags("kv_producer", port=side_channel), placement.prefill),
                     "decode": (p2p_flags("kv_consumer", allowed_producers=[f"127.0.0.1:{side_channel}"]),
                                placement.decode)}
        else:
            sides = {"colocated": ([], placement.colocated)}
        urls = {}
        for name, (flags, core) in sides.items():
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            processes.append(start_process(pinned(serve_command(model, port, args, flags), core), logs / f"{name}.log"))
        for (name, url), process in zip(urls.items(), processes):
            wait_healthy(url, process, logs / f"{name}.log", args.startup_timeout)
        url = urls.get("colocated", "")
        if router is not None:
            port = free_port()
            if arm == "disaggregated":
                command = pd_router_command(router, port, urls["prefill"], urls["decode"])
            else:
                command = [router, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", url, "--policy",
                           "round_robin", "--prometheus-port", str(free_port()), "--log-level", "warning"]
            processes.append(start_process(pinned(command, placement.front), logs / f"{arm}_router.log"))
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, processes[-1], logs / f"{arm}_router.log", 60)
        asyncio.run(drive(url, model, workload, args, result))
    except Exception as error:  # noqa: BLE001 - one arm failing is reported, the other still runs
        result.error = f"{type(error).__name__}: {error}"[:500]
    finally:
        for process in reversed(processes):
            stop_process(process, term_timeout=10)
    return result


# ------------------------------------------------------------------ the report
def table(results: list[ArmResult]) -> str:
    lines = [f"{'':14} {'':9} {'stream ITL under the flood (ms)':^37} {'flood TTFT (ms)':^17} {'flood':>9}",
             f"{'arm':14} {'quiet p50':>9} {'mean':>7} {'p50':>7} {'p99':>7} {'max':>7} {'n':>5} {'p50':>8} "
             f"{'p99':>8} {'completed':>9}"]
    for r in results:
        lines.append(f"{r.arm:14} {r.itl_quiet_p50_ms:9.1f} {r.itl_flood_mean_ms:7.1f} {r.itl_flood_p50_ms:7.1f} "
                     f"{r.itl_flood_p99_ms:7.1f} {r.itl_flood_max_ms:7.1f} {r.itl_flood_samples:5d} "
                     f"{r.flood_ttft_p50_ms:8.0f} {r.flood_ttft_p99_ms:8.0f} "
                     f"{r.flood_completed:>4}/{r.flood_requests:<4}"
                     + (f"  error: {r.error}" if r.error else ""))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="microvllm bench pd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a small run on a tiny random model (structure and tokens, not figures)")
    parser.add_argument("--model", default=None, help="'tiny', a model folder, or (default) the embedded model")
    parser.add_argument("--stream-tokens", type=int, default=640, help="the decode stream's output tokens")
    parser.add_argument("--warmup-tokens", type=int, default=24, help="stream tokens before the flood starts")
    parser.add_argument("--num-flood", type=int, default=10)
    parser.add_argument("--flood-tokens", type=int, default=512, help="each flood prompt's length in tokens")
    parser.add_argument("--flood-rate", type=float, default=0.5, help="flood arrivals/s (Poisson); inf: a burst")
    parser.add_argument("--flood-max-tokens", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256, help="the chunked-prefill budget")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--arms", nargs="+", default=["colocated", "disaggregated"],
                        choices=["colocated", "disaggregated"])
    parser.add_argument("--no-pin", action="store_true", help="leave the processes unpinned")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", default=None, help="folder for the processes' logs (default: a temporary one)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.model = args.model or "tiny"
        args.stream_tokens, args.warmup_tokens, args.num_flood = min(args.stream_tokens, 48), 4, min(args.num_flood, 4)
        args.flood_tokens, args.flood_rate, args.flood_max_tokens = min(args.flood_tokens, 200), 20.0, 2
        args.max_num_batched_tokens, args.max_model_len = 64, 512
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    arms = list(args.arms)
    if "disaggregated" in arms and vllm_router_binary() is None:
        print("vllm-router is not installed (pip install vllm-router): leaving out the disaggregated arm, "
              "and driving the colocated server directly")
        arms.remove("disaggregated")
    placement = Placement.for_machine(not args.no_pin)
    own_affinity = cores()
    with tempfile.TemporaryDirectory(prefix="bench-pd-") as scratch:
        logs = Path(args.logs) if args.logs else Path(scratch)
        logs.mkdir(parents=True, exist_ok=True)
        model = resolve_model(args.model, Path(scratch))
        from microvllm.tokenizer import Tokenizer

        workload = make_workload(Tokenizer.from_pretrained(model), args)
        print(f"{cpu_description()}\nmodel {model}\nstream: {args.stream_tokens} greedy tokens, flood after "
              f"{args.warmup_tokens}: {args.num_flood} prompts of {min(workload.flood_tokens)}-"
              f"{max(workload.flood_tokens)} tokens at {args.flood_rate}/s, {args.flood_max_tokens} output tokens "
              f"each; chunked prefill {args.max_num_batched_tokens} tokens/step, OMP_NUM_THREADS=1", flush=True)
        results = []
        try:
            if placement.front is not None:
                os.sched_setaffinity(0, {placement.front})
            for arm in arms:
                started = time.monotonic()
                results.append(run_arm(arm, model, workload, args, placement, logs))
                print(f"  {arm} ({results[-1].pinned}): {time.monotonic() - started:.0f} s", flush=True)
        finally:
            if own_affinity:
                os.sched_setaffinity(0, own_affinity)
    print(table(results))
    done = [r for r in results if not r.error]
    same = len(done) == len(results) and all(r.tokens == done[0].tokens for r in done)
    if len(done) >= 2:
        print(f"stream's greedy tokens identical across arms: {'yes' if same else 'NO'} "
              f"({len(done[0].tokens)} tokens)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(
            {"cpu": cpu_description(), "model": model, "results": [vars(r) for r in results]}, indent=2))
    ok = all(not r.error and r.flood_completed == r.flood_requests and r.stream_tokens == args.stream_tokens
             for r in results)
    return 0 if ok and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
