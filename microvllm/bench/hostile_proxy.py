"""``microvllm bench hostile``, the router's part: what hostile requests and a dying replica
cost the others when the course's HTTP proxy (``router/http_proxy.py``) stands in front.

Starts two ``microvllm serve`` replicas (the embedded model unless ``--model``) and the
proxy (its default policy, prefix_aware) on 127.0.0.1, keeps one greedy chat stream running
through the proxy as a well-behaved client would, and sends the proxy its attacks one after
another: megabyte prompts, a body over its limit, JSON that is no object, and the stream's
own replica killed with SIGKILL midway, then started again on its port. For each attack it
prints the answers and the stream's largest and median gap between tokens (as
``hostile.py``); then whether a normal request still gives the same greedy text and the
proxy's resident memory after warm-up and after the set.

    python -m microvllm bench hostile --set proxy [--model FOLDER] [--quick]

Figures depend on the machine: run it with nothing else running.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

from microvllm.bench.hostile import CHAT, Server, Stream, greedy_text, send
from microvllm.testing import free_ports, start_process, stop_process, wait_healthy
from microvllm.testing.server import rss_mb

REPLICA_FLAGS = ["--max-num-seqs", "16", "--shutdown-timeout", "1"]
KILL_ATTACK = "stream's replica killed, restarted"


class Replica(Server):
    """``hostile.Server`` on a port chosen here: a killed replica comes back on its own port."""

    def __init__(self, model: str | None, port: int, log: Path):
        super().__init__(model, REPLICA_FLAGS, log, port)


class Proxy:
    """``python -m microvllm.router.http_proxy`` in front of ``replicas``."""

    def __init__(self, folder: str, replicas: list[str], port: int, log: Path):
        self.url, self.log_path = f"http://127.0.0.1:{port}", log
        command = [sys.executable, "-m", "microvllm.router.http_proxy", "--model", folder, "--port", str(port)]
        for url in replicas:
            command += ["--replica", url]
        self.process = start_process(command, log)

    def wait_healthy(self, timeout: float = 120) -> None:
        wait_healthy(self.url, self.process, self.log_path, timeout)

    def alive(self) -> bool:
        import httpx

        try:
            return self.process.poll() is None and httpx.get(self.url + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def stats(self) -> dict:
        import httpx

        return httpx.get(self.url + "/router/stats", timeout=10).json()

    def rss_mb(self) -> float:
        return rss_mb(self.process.pid)

    def stop(self) -> None:
        stop_process(self.process, term_timeout=0)


# ---- the attacks: each returns its answers, in words --------------------------------------

def at_once(url: str, requests: list[tuple[str, str, dict | bytes]]) -> list[str]:
    """``hostile.send`` each request, all at the same time."""
    results: list[str] = []
    threads = [threading.Thread(target=lambda r=r: results.append(send(url, *r))) for r in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def attacks(quick: bool) -> list[tuple[str, list[tuple[str, str, dict | bytes]]]]:
    """(name, requests sent at once to the proxy: (method, path, JSON body or raw bytes))."""
    big = "word " * 800_000                                             # 4 MB of text
    copies = 1 if quick else 2
    return [
        (f"{copies} x 4 MB prompt", [("POST", "/v1/completions", {"prompt": big, "max_tokens": 4})] * copies),
        (f"{copies} x 4 MB chat message",
         [("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": big}]})] * copies),
        ("9 MB body (over the 8 MiB limit)",
         [("POST", "/v1/completions", b'{"prompt": "' + b"a" * (9 << 20) + b'"}')]),
        ("JSON that is no object", [("POST", "/v1/completions", raw) for raw in (b"[1, 2]", b'"x"', b"3")]),
        ("malformed JSON", [("POST", "/v1/chat/completions", b'{"messages": [')]),
    ]


def kill_the_streams_replica(proxy: Proxy, replicas: list[Replica], model: str | None, logs: Path) -> list[str]:
    """Open a second stream of the same chat as the background one (prefix_aware sends it to
    the same replica), kill that replica after a few tokens, start it again on its port, and
    say how the killed stream ended and when the proxy had the replica back."""
    import httpx

    body = {"messages": CHAT, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    before = proxy.stats()["in_flight"]
    payloads: list[str] = []
    victim, shared = -1, False
    try:
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    payloads.append(line.removeprefix("data: "))
                if len(payloads) == 5 and victim < 0:
                    now = proxy.stats()["in_flight"]
                    victim = max(range(len(now)), key=lambda i: now[i] - before[i])   # where ours went
                    shared = now[victim] > 1                                       # the background one too
                    replicas[victim].stop()                                        # SIGKILL
        ending = how_it_ended(payloads)
    except httpx.HTTPError as error:
        ending = f"cut off: {type(error).__name__}"
    if victim < 0:
        return [f"the stream ended first ({ending})"]
    started = time.monotonic()
    replicas[victim] = Replica(model, replicas[victim].port, logs / f"microvllm-bench-hostile-proxy-{victim}b.log")
    replicas[victim].wait_healthy()
    while not all(proxy.stats()["healthy"]):
        if time.monotonic() - started > 300:
            return [ending, "never back in rotation"]
        time.sleep(0.2)
    back = f"back in {time.monotonic() - started:.0f} s"
    return [ending, back] if shared else [ending, back, "not the stream's replica"]


def how_it_ended(payloads: list[str]) -> str:
    """The stream's end in words: "error event+[DONE]" when it ended as a failed stream should."""
    if len(payloads) >= 2 and payloads[-1] == "[DONE]" and payloads[-2].startswith('{"error"'):
        return "error event+[DONE]"
    return f"ended: {payloads[-1][:24]!r}" if payloads else "ended: nothing"


def run(model: str | None, logs: Path, quick: bool) -> bool:
    """The bench; True when the proxy lived through the set, a greedy request gave the same
    text after it, the proxy's memory stayed within 10% of its start, the background stream
    never waited 1 s for a token (but during the attack that kills its replica), and the
    killed replica's stream ended with an error event and ``[DONE]``."""
    from microvllm.models.default_model import default_model_path

    folder = model or str(default_model_path())   # the proxy tokenizes with the replicas' tokenizer
    *ports, proxy_port = free_ports(3)
    replicas = [Replica(model, port, logs / f"microvllm-bench-hostile-proxy-{i}.log") for i, port in enumerate(ports)]
    proxy: Proxy | None = None
    try:
        for replica in replicas:
            replica.wait_healthy()
        proxy = Proxy(folder, [r.url for r in replicas], proxy_port, logs / "microvllm-bench-hostile-proxy.log")
        proxy.wait_healthy()
        for _ in replicas:   # warm-up: a chat on each replica (the policy balances two idle ones)
            send(proxy.url, "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8})
        reference = greedy_text(proxy.url)
        rss_warm = proxy.rss_mb()
        stream = Stream(proxy.url)
        time.sleep(3)
        base = stream.gaps_between(time.monotonic() - 3, time.monotonic()) or [0.0]
        print(f"{'attack':38} {'answers':34} {'largest gap':>12} {'median gap':>11}")
        alone = f"{max(base) * 1e3:10.0f} ms {statistics.median(base) * 1e3:8.0f} ms"
        print(f"{'(none: the stream alone)':38} {'':34} {alone}")
        largest: dict[str, float] = {}
        killed_stream = ""
        for name, requests in [*attacks(quick), (KILL_ATTACK, None)]:
            start = time.monotonic()
            if requests is None:
                results = kill_the_streams_replica(proxy, replicas, model, logs)
                killed_stream = results[0]
            else:
                results = at_once(proxy.url, requests)
            time.sleep(0.3)                  # a token held back by a stall lands now
            gaps = stream.gaps_between(start, time.monotonic()) or [0.0]
            largest[name] = max(gaps)
            answers = ", ".join(sorted(set(results)) if requests else results)[:34]
            print(f"{name:38} {answers:34} {max(gaps) * 1e3:10.0f} ms {statistics.median(gaps) * 1e3:8.0f} ms")
        stream.stop()
        time.sleep(1)
        alive = proxy.alive()
        same = alive and greedy_text(proxy.url) == reference
        rss_after = proxy.rss_mb()
        growth = rss_after / rss_warm - 1
        print(f"\nafter the set: proxy alive: {alive}; greedy text as before the set: {same}; "
              f"replicas in rotation: {proxy.stats()['healthy'] if alive else '?'}")
        print(f"RSS, proxy process: {rss_warm:.0f} MB after warm-up, {rss_after:.0f} MB after the set ({growth:+.1%})")
        stalls = {name: gap for name, gap in largest.items() if name != KILL_ATTACK and gap >= 1.0}
        if stalls:
            print("the stream waited 1 s or more for a token during: " + ", ".join(stalls))
        return (alive and same and growth <= 0.10 and not stalls
                and killed_stream == "error event+[DONE]")
    finally:
        for process in [proxy, *replicas]:
            if process is not None:
                process.stop()

