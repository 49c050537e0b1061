"""``microvllm bench hostile``: what hostile requests cost the others, measured.

Starts ``microvllm serve`` (the embedded model unless ``--model``) on 127.0.0.1, keeps one
greedy stream running as a well-behaved client would, and sends the attacks of issue 38
one after another. For each it prints the attack's answers and the stream's largest and
median gap between tokens while it ran; then the server's resident memory (the server
process and its grammar-compile workers) after warm-up and after the whole set,
whether a normal request still gives the same greedy text, the KV usage once idle, and
how long SIGTERM takes to stop a second server in the middle of a long compile.

    python -m microvllm bench hostile [--model FOLDER] [--quick] [--set all|server|pd|events-tier|proxy]

This module is the first set (one server); ``bench/hostile_sets.py`` runs it and the
others, each on servers of its own (``--set`` picks one): ``pd``, a client of a
prefill/decode pair (``bench/hostile_pd.py``); ``events-tier``, the KV event sockets and
the file-backed KV tier (``bench/hostile_events_tier.py``); ``proxy``, the course's HTTP
proxy in front of two replicas (``bench/hostile_proxy.py``). Each prints its table and a
verdict: no poisoned answer, no server death, memory within 10 % of its start, the
concurrent stream's largest gap under 1 s.

Figures depend on the machine: run it with nothing else running.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from microvllm.testing import ServeProcess
from microvllm.testing.server import rss_mb

CHAT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


class Server(ServeProcess):
    """``microvllm serve`` for the hostile sets: ``ServeProcess`` plus the memory of its
    grammar-compile workers and its KV usage."""

    def __init__(self, model: str | None, flags: list[str], log: Path, port: int | None = None):
        super().__init__(model, log, flags, port)

    def memory_mb(self) -> tuple[float, float]:
        """(the server process's RSS, its compile workers' RSS together) in MB."""
        return self.rss_mb(), sum(rss_mb(pid) for pid in compile_worker_pids(self.process.pid))

    def kv_usage(self) -> float:
        return self.metrics().get("kv_cache_usage_perc", float("nan"))


def compile_worker_pids(server_pid: int) -> set[int]:
    """The pids of a server's grammar-compile processes (its children running
    ``compile_workers``; ``-ww``: never cut the command line at the terminal's width)."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(server_pid)],
                         capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines() if "compile_workers" in line}


class Stream:
    """One greedy chat stream after another; records when each token arrived and when each
    response began. A gap is measured between two tokens of one response: the first token
    of the next response waits for its prefill behind whatever is queued (that is
    queueing, not a stall of the stream)."""

    def __init__(self, url: str):
        self.url, self.times, self.starts, self.stopped = url, [], [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        import httpx

        body = {"messages": CHAT, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        while not self.stopped.is_set():
            self.starts.append(time.monotonic())
            try:
                with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=120) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: ") and '"content"' in line:
                            self.times.append(time.monotonic())
                        if self.stopped.is_set():
                            return
            except Exception:  # noqa: BLE001 - a failed stream shows as a gap
                time.sleep(0.1)

    def gaps_between(self, start: float, end: float) -> list[float]:
        times = [t for t in list(self.times) if start <= t <= end]
        starts = list(self.starts)
        return [b - a for a, b in zip(times, times[1:]) if not any(a < s < b for s in starts)]

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(30)


def ref_chain(depth: int) -> dict:
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def object_chain(depth: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(depth)}
    defs[f"d{depth}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def attacks(quick: bool) -> list[tuple[str, list[tuple[str, str, dict | bytes]]]]:
    """(name, requests sent at once: (method, path, JSON body or raw bytes))."""
    def chat(**body):
        return ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 16, **body})

    def schema(value):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}

    big = "word " * 1_600_000
    regexes = [chat(structured_outputs={"regex": f"(ab|cd){{{i + 1}}}[0-9]{{2}}"}) for i in range(30)]
    return [
        ("4,000-deep $ref object chain", [chat(response_format=schema(object_chain(4000)))]),
        ("3,000-long $ref chain", [chat(response_format=schema(ref_chain(3000)))]),
        ("6 x 20,000-entry choice", [chat(structured_outputs={"choice": [str(i) for i in range(20000)]})] * 6),
        ("6 x 4,096-entry choice (the limit)",
         [chat(structured_outputs={"choice": [f"option {i} {j}" for i in range(4096)]}) for j in range(6)]),
        ("30 distinct small regexes", regexes),
        ("n=200000", [chat(n=200_000)]),
        ("n=64", [chat(n=64, max_tokens=8)]),
        ("8 x 8 MB chat messages", [("POST", "/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": big}]})] * (2 if quick else 8)),
        ("/detokenize of 2M ids", [("POST", "/detokenize", {"tokens": [i % 1000 for i in range(2_000_000)]})]),
        ("logprobs with a grammar", [chat(logprobs=True, top_logprobs=5, structured_outputs={"regex": "[0-9]{4}"})]),
        ("impossible regex", [chat(structured_outputs={"regex": "[^\\s\\S]"})]),
        ("emoji choice", [chat(structured_outputs={"choice": ["😀 smile", "🙂 ok"]})]),
        ("100 MB body", [("POST", "/v1/completions", b'{"prompt": "' + b"a" * (100 << 20) + b'"}')]),
    ]


def send(url: str, method: str, path: str, body) -> str:
    import httpx

    started = time.monotonic()
    try:
        if isinstance(body, bytes):
            response = httpx.request(method, url + path, content=body, timeout=180,
                                     headers={"content-type": "application/json"})
        else:
            response = httpx.request(method, url + path, json=body, timeout=180)
        status = str(response.status_code)
    except httpx.HTTPError as error:
        status = type(error).__name__
    return f"{status} in {time.monotonic() - started:.1f} s"


def slow_clients(url: str, count: int, seconds: float) -> str:
    """``count`` connections sending a request one byte per second."""
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(count):
        s = socket.create_connection((host, int(port)))
        sockets.append(s)
    payload = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 100000\r\n\r\n" + b"a" * 1000
    end = time.monotonic() + seconds
    index = 0
    while time.monotonic() < end:
        for s in sockets:
            try:
                s.send(payload[index:index + 1])
            except OSError:
                pass
        index += 1
        time.sleep(1.0)
    for s in sockets:
        s.close()
    return f"{count} connections for {seconds:.0f} s"


def greedy_text(url: str) -> str:
    import httpx

    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24,
            "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]["content"]


def sigterm_during_compile(model: str | None, log: Path) -> float:
    """Seconds from SIGTERM to exit for a server compiling a long grammar (limits lifted
    so that it reaches the compiler, --shutdown-timeout 5)."""
    server = Server(model, ["--structured-outputs-max-schema-depth", "100000", "--shutdown-timeout", "5"], log)
    try:
        server.wait_healthy()
        body = {"messages": CHAT, "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(3000)}}}
        threading.Thread(target=send, args=(server.url, "POST", "/v1/chat/completions", body), daemon=True).start()
        time.sleep(2.0)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(120)
        return time.monotonic() - started
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    """The first set alone (``bench/hostile_sets.py`` runs it with the others)."""
    parser = argparse.ArgumentParser(prog="microvllm bench hostile --set server",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--quick", action="store_true", help="fewer 8 MB chats")
    args = parser.parse_args(argv)
    server_set(args, Path(os.environ.get("TMPDIR", "/tmp")))
    return 0


def server_set(args: argparse.Namespace, logs: Path) -> None:
    """The first set: hostile requests to one server (see the module docstring)."""
    server = Server(args.model, ["--max-num-seqs", "16"], logs / "microvllm-bench-hostile.log")
    try:
        server.wait_healthy()
        send(server.url, *attacks(True)[3][1][0])            # warm-up: the compile worker, a big grammar
        send(server.url, "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8})
        reference = greedy_text(server.url)
        rss_warm = server.memory_mb()
        stream = Stream(server.url)
        time.sleep(3)
        base = stream.gaps_between(time.monotonic() - 3, time.monotonic())
        print(f"{'attack':38} {'answers':34} {'largest gap':>12} {'median gap':>11}")
        alone = f"{max(base) * 1e3:10.0f} ms {statistics.median(base) * 1e3:8.0f} ms"
        print(f"{'(none: the stream alone)':38} {'':34} {alone}")
        rows = [(name, requests) for name, requests in attacks(args.quick)]
        for name, requests in rows + [("50 clients at 1 byte/s", None)]:
            start = time.monotonic()
            results: list[str] = []
            if requests is None:
                results.append(slow_clients(server.url, 50, 10))
            else:
                threads = [threading.Thread(target=lambda r=r: results.append(send(server.url, *r))) for r in requests]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            end = time.monotonic()
            gaps = stream.gaps_between(start, end) or [0.0]
            answers = ", ".join(sorted(set(results)))[:34]
            print(f"{name:38} {answers:34} {max(gaps) * 1e3:10.0f} ms {statistics.median(gaps) * 1e3:8.0f} ms")
        stream.stop()
        time.sleep(2)
        import httpx

        health = httpx.get(server.url + "/health", timeout=10).status_code
        same = greedy_text(server.url) == reference
        rss_after = server.memory_mb()
        print(f"\nafter the set: /health {health}; greedy text as before the set: {same}; "
              f"KV usage when idle: {server.kv_usage():.3f}")
        print(f"RSS, server process: {rss_warm[0]:.0f} MB after warm-up, {rss_after[0]:.0f} MB after the set "
              f"({(rss_after[0] / rss_warm[0] - 1) * 100:+.1f}%); compile workers: {rss_warm[1]:.0f} -> "
              f"{rss_after[1]:.0f} MB")
    finally:
        server.stop()
    took = sigterm_during_compile(args.model, logs / "microvllm-bench-hostile-sigterm.log")
    print(f"SIGTERM during a long compile (--shutdown-timeout 5): exited after {took:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
