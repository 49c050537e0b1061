"""The course's HTTP proxy (``router/http_proxy.py``) against hostile clients and dying
replicas, for real: two ``microvllm serve`` replicas of a tiny model and the proxy in
front of them (round_robin: both replicas get work), all on 127.0.0.1, booted once.

    client ──> python -m microvllm.router.http_proxy ──┬──> microvllm serve (replica 0)
                                                       └──> microvllm serve (replica 1)

A test that kills a replica starts it again on the same port before it ends, so the next
test finds the cluster whole. Every wait is a poll against a deadline; the fixture stops
every process either way.
"""

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from microvllm.models.tiny import make_tiny_model
from microvllm.testing import free_ports, start_process, stop_process
from tests.support import ROOT, STARTUP_TIMEOUT, Server, wait_for

pytestmark = pytest.mark.multiprocess

LONG = {"prompt": "the scheduler", "max_tokens": 1000, "temperature": 0.0, "ignore_eos": True}  # near max-model-len


class Proxy:
    """``python -m microvllm.router.http_proxy`` (only the flags it always had: its defaults
    are what is tested)."""

    def __init__(self, folder: Path, replicas: list[str], port: int, log: Path):
        self.url, self.log_path = f"http://127.0.0.1:{port}", log
        command = [sys.executable, "-m", "microvllm.router.http_proxy", "--model", str(folder),
                   "--policy", "round_robin", "--port", str(port)]
        for url in replicas:
            command += ["--replica", url]
        self.process = start_process(command, log, env={"PYTHONPATH": str(ROOT)}, cwd=ROOT)

    def healthy(self) -> bool:
        assert self.process.poll() is None, f"the proxy exited:\n{self.log_path.read_text()[-3000:]}"
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stats(self) -> dict:
        return httpx.get(self.url + "/router/stats", timeout=10).json()

    def stop(self) -> None:
        stop_process(self.process, term_timeout=0)


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.folder = make_tiny_model(root / "llama", "llama", seed=11)
        *ports, proxy_port = free_ports(3)
        self.replicas = [Server(self.folder, root / f"replica{i}.log", port=port) for i, port in enumerate(ports)]
        self.proxy: Proxy | None = None
        for replica in self.replicas:
            wait_for(replica.healthy, STARTUP_TIMEOUT, "a replica's /health")
        self.proxy = Proxy(self.folder, [r.url for r in self.replicas], proxy_port, root / "proxy.log")
        wait_for(self.proxy.healthy, 60, "the proxy's /health")

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def complete(self, **body) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", json={"prompt": "a block", "max_tokens": 4,
                                                              "temperature": 0.0, **body}, timeout=60)

    def kill(self, replica: int) -> None:
        """SIGKILL: no goodbye, its sockets just close."""
        self.replicas[replica].stop()

    def restart(self, replica: int) -> None:
        """Start ``replica`` again on its port; wait until the proxy has it back in rotation."""
        old = self.replicas[replica]
        self.replicas[replica] = Server(self.folder, self.root / f"replica{replica}-again.log", port=old.port)
        wait_for(self.replicas[replica].healthy, STARTUP_TIMEOUT, "the restarted replica's /health")
        assert self.proxy is not None
        wait_for(lambda: self.proxy.stats().get("healthy") == [True, True], 30,
                 "the proxy to put the restarted replica back in rotation")

    def stop(self) -> None:
        for process in [self.proxy, *self.replicas]:
            if process is not None:
                process.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("proxy")
    cluster = None
    try:
        cluster = Cluster(root)
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()


def assert_openai_error(response: httpx.Response, status: int, kind: str) -> dict:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert error["type"] == kind and error["code"] == status and error["param"] is None
    assert isinstance(error["message"], str) and error["message"]
    return error


def read_stream(response: httpx.Response, on_data=None) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream, in order."""
    payloads = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payloads.append(line.removeprefix("data: "))
            if on_data is not None:
                on_data(payloads)
    return payloads


class ChunkClock:
    """Greedy streams through the proxy, one after another, on a thread: when each chunk came."""

    def __init__(self, url: str):
        self.url, self.times, self.stopped = url, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stopped.is_set():
            with httpx.stream("POST", self.url + "/v1/completions", json={**LONG, "stream": True},
                              timeout=120) as response:
                for _ in response.iter_lines():
                    self.times.append(time.monotonic())
                    if self.stopped.is_set():
                        return

    def largest_gap(self, start: float, end: float) -> float:
        """The longest wait for a chunk that overlaps ``[start, end]``."""
        times = list(self.times)
        return max((b - a for a, b in zip(times, times[1:]) if b >= start and a <= end), default=float("inf"))

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(60)


# ---- bodies ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_that_is_no_json_object_gets_an_openai_400(cluster, path):
    for raw in [b"[1, 2]", b'"x"', b"3", b"null", b"{not json", b""]:
        response = httpx.post(cluster.url + path, content=raw, headers={"content-type": "application/json"},
                              timeout=30)
        assert_openai_error(response, 400, "BadRequestError")
    assert cluster.complete().status_code == 200   # and the proxy goes on


def test_a_body_over_the_limit_gets_an_openai_413(cluster):
    raw = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'   # the default limit is 8 MiB
    response = httpx.post(cluster.url + "/v1/completions", content=raw, timeout=120,
                          headers={"content-type": "application/json"})
    error = assert_openai_error(response, 413, "RequestTooLargeError")
    assert "--max-request-body-bytes" in error["message"]


def test_a_4mb_prompt_does_not_stall_a_concurrent_stream(cluster):
    clock = ChunkClock(cluster.url)
    try:
        wait_for(lambda: len(clock.times) >= 20, 60, "the stream's first chunks")
        start = time.monotonic()
        response = cluster.complete(prompt="word " * 800_000)            # 4 MB: under the limit
        end = time.monotonic()
        time.sleep(0.5)                                                  # a stalled chunk lands after
    finally:
        clock.stop()
    assert response.status_code == 400, response.text[:300]              # too long for the replica
    assert "error" in response.json()
    gap = clock.largest_gap(start, end)
    assert gap < 1.0, f"the stream waited {gap:.2f} s for a chunk while the proxy took a 4 MB prompt"


# ---- dying replicas -----------------------------------------------------------------------

def test_a_killed_replica_is_ejected_and_readmitted_once_restarted(cluster):
    cluster.kill(1)
    answers = [cluster.complete().status_code for _ in range(8)]
    assert answers == [200] * 8, answers                 # not every second one a 502
    stats = cluster.proxy.stats()
    assert stats["healthy"] == [True, False] and stats["ejections"][1] >= 1
    with httpx.stream("POST", cluster.url + "/v1/completions", timeout=60,
                      json={"prompt": "a stream", "max_tokens": 4, "stream": True}) as response:
        assert response.status_code == 200
        assert read_stream(response)[-1] == "[DONE]"

    cluster.restart(1)                                   # waits for "healthy": [True, True]
    served = cluster.proxy.stats()["served"][1]
    assert [cluster.complete().status_code for _ in range(4)] == [200] * 4
    assert cluster.proxy.stats()["served"][1] >= served + 2   # round robin: its turns again


def test_a_stream_whose_replica_dies_ends_with_an_error_event_then_done(cluster):
    """The replica serving a stream is killed after 5 events. The kill must land while it is
    still generating: on a loaded machine the tiny model can finish all its tokens (the
    proxy buffering them for a reader that fell behind) before the reader gets to 5, and
    then neither replica is in flight. Such a try tests nothing, so it is run again."""
    for _ in range(3):
        killed, outran = [], []

        def kill_after_a_few(payloads):
            if len(payloads) == 5:
                in_flight = cluster.proxy.stats()["in_flight"]
                if sorted(in_flight) != [0, 1]:
                    assert in_flight == [0, 0], in_flight   # one stream open: never two
                    outran.append(True)
                    return
                killed.append(in_flight.index(1))
                cluster.kill(killed[0])

        try:
            with httpx.stream("POST", cluster.url + "/v1/completions", json={**LONG, "stream": True},
                              timeout=60) as response:
                assert response.status_code == 200
                payloads = read_stream(response, kill_after_a_few)   # no "incomplete chunked read"
            if outran:
                assert payloads[-1] == "[DONE]" and json.loads(payloads[-2])["choices"][0]["finish_reason"]
                continue
            assert killed, "the stream ended before its replica could be killed"
            assert payloads[-1] == "[DONE]"
            error = json.loads(payloads[-2])["error"]
            assert error["type"] == "ServiceUnavailableError" and error["code"] == 503 and error["message"]
            for payload in payloads[:-2]:
                chunk = json.loads(payload)                          # every event before it is whole
                assert chunk["choices"][0]["finish_reason"] is None  # and the stream did not finish
            assert cluster.complete().status_code == 200             # the other replica takes the next one
            return
        finally:
            if killed:
                cluster.restart(killed[0])
    pytest.fail("in 3 tries the replica always finished its stream before the 5th event was read")

