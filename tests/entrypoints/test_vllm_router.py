"""The real vLLM router (``pip install vllm-router``, the Rust gateway vLLM ships; its
binary ``vllm-router``) in front of two ``microvllm serve`` replicas on 127.0.0.1: it
drives them unchanged, as it drives vLLM's, and reads the same names from ``/metrics``.

    client ──> vllm-router --policy P ──┬──> microvllm serve (replica 0)
                                        └──> microvllm serve (replica 1)

Which replica served what is read from each replica's ``/metrics`` (vLLM's names:
``vllm:request_success_total``, ``vllm:prefix_cache_hits_total``, ...). Every wait is a
poll against a deadline; every process is stopped by the fixtures.
"""

import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from microvllm.models.tiny import make_tiny_model
from tests.support import ROUTER, Server, free_port, wait_for

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not Path(ROUTER).is_file(),
                       reason="the vllm-router wheel is not installed (pip install vllm-router: the dev extra)"),
]


def counter(url: str, name: str) -> float:
    """The sum of one ``vllm:`` counter's samples on a replica's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"vllm:{name}{{"))


class Router:
    def __init__(self, replicas: list[Server], policy: str, log: Path, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")
        self.process = subprocess.Popen(
            [ROUTER, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
             "--worker-urls", *[r.url for r in replicas], "--log-level", "warning", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self.healthy, 60, f"vllm-router ({policy}) to start")

    def healthy(self) -> bool:
        assert self.process.poll() is None, "vllm-router exited"
        try:
            return httpx.get(self.url + "/health", timeout=3).status_code == 200
        except httpx.HTTPError:
            return False

    def complete(self, prompt: str, model: str, timeout: float = 60) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", timeout=timeout,
                          json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("router")
    folder = make_tiny_model(root / "model", "llama", seed=3)
    servers = [Server(folder, root / f"replica{i}.log") for i in range(2)]
    try:
        for server in servers:
            wait_for(server.healthy, 180, "a replica to start")
        yield folder, servers, root
    finally:
        for server in servers:
            server.stop()


def served(servers) -> list[float]:
    return [counter(s.url, "request_success_total") for s in servers]


@pytest.mark.parametrize("policy", ["round_robin", "power_of_two"])
def test_the_router_spreads_requests_over_our_replicas(replicas, policy):
    folder, servers, root = replicas
    router = Router(servers, policy, root / f"router_{policy}.log")
    try:
        before = served(servers)
        for i in range(8):
            response = router.complete(f"question {i}: what is a paged KV cache?", str(folder))
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] == "length"
        after = served(servers)
        per_replica = [a - b for a, b in zip(after, before)]
        assert sum(per_replica) == 8
        if policy == "round_robin":
            assert per_replica == [4, 4]
    finally:
        router.stop()


def test_cache_aware_keeps_a_prefix_on_one_replica(replicas):
    """Round robin computes each shared prefix on both replicas; the router's cache_aware
    policy (an approximate radix tree of the prompts it sent where) sends every request
    of a prefix where the prefix went first, so more of each prompt is a prefix-cache hit."""
    folder, servers, root = replicas

    def hits_for(policy: str, tag: str) -> float:
        prefixes = [f"{tag} system prompt {k}: " + " ".join(f"rule {tag}{k}{j}." for j in range(40))
                    for k in range(3)]
        router = Router(servers, policy, root / f"router_cache_{policy}.log")
        try:
            before = sum(counter(s.url, "prefix_cache_hits_total") for s in servers)
            for i in range(9):   # 3 prefixes against 2 replicas: round robin splits each prefix
                response = router.complete(prefixes[i % 3] + f" Question {i}?", str(folder))
                assert response.status_code == 200, response.text
            return sum(counter(s.url, "prefix_cache_hits_total") for s in servers) - before
        finally:
            router.stop()

    round_robin, cache_aware = hits_for("round_robin", "rr"), hits_for("cache_aware", "ca")
    assert cache_aware > round_robin > 0, (round_robin, cache_aware)


def test_a_killed_replica_is_taken_out_and_rejoins(replicas, tmp_path):
    """Kill one replica: every request still gets an answer (the router retries on the
    other) or a clear error status, never a hang; started again on its port, it serves."""
    folder, servers, root = replicas
    victim = servers[1]
    router = Router(servers, "round_robin", root / "router_kill.log", "--health-check-interval-secs", "1",
                    "--health-failure-threshold", "1", "--health-success-threshold", "1")
    try:
        victim.stop()
        started = time.monotonic()
        statuses = [router.complete(f"after the kill {i}", str(folder), timeout=30).status_code for i in range(6)]
        assert time.monotonic() - started < 60
        assert statuses.count(200) >= 4 and all(s == 200 or s >= 500 for s in statuses), statuses
        # The replica comes back on the same port: the router's health check lets it in again.
        servers[1] = Server(folder, tmp_path / "back.log", port=victim.port)
        wait_for(servers[1].healthy, 180, "the replica to start again")
        before = counter(servers[1].url, "request_success_total")

        def served_by_the_replica() -> bool:
            assert router.complete("is it back?", str(folder), timeout=30).status_code == 200
            return counter(servers[1].url, "request_success_total") > before

        wait_for(served_by_the_replica, 60, "the router to send requests to the restarted replica", interval=1)
    finally:
        router.stop()
