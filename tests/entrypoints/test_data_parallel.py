"""``microvllm serve --data-parallel-size 2``, for real: one API server process (one
``AsyncLLM``, its client a ``DPLBMPClient``) and two engine-core processes
(``EngineCoreProc``) on 127.0.0.1.

The same greedy text as one engine; requests spread over both cores by load (each
core's count under vLLM's ``engine`` label in /metrics); a cancelled stream frees its
blocks on the core that ran it; a killed core stops the server (a supervisor restarts
it) and no process is left behind.
"""

import asyncio
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from microvllm import LLM
from microvllm.models.tiny import make_tiny_model
from tests.support import LLM_SETTINGS, SETTINGS, STARTUP_TIMEOUT, Server, alive, core_pids, free_port, wait_for

pytestmark = pytest.mark.multiprocess


def per_engine(url: str, name: str) -> dict[str, float]:
    """One ``vllm:`` metric's value per engine core (summed over its other labels)."""
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        match = re.match(rf'vllm:{name}{{engine="(\d+)"[^}}]*}} (\S+)$', line)
        if match:
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(2))
    return values


@dataclass
class DPServer:
    server: Server
    url: str
    folder: str
    events_port: int      # core r publishes its KV events on events_port + r
    root: Path            # the server's TMPDIR: its IPC socket folder lives there
    killed: Path          # a socket folder as a server killed with -9 left it (its pid dead)


@pytest.fixture(scope="module")
def dp_server():
    """One data-parallel server (two cores, KV events on) shared by the module's tests, which
    only read from it; the last test stops it with SIGTERM. Its TMPDIR is short (IPC paths
    are limited to ~100 characters) and holds a dead server's socket folder when it starts."""
    root = Path(tempfile.mkdtemp(prefix="mvdp", dir="/tmp"))
    gone = subprocess.Popen(["true"])
    gone.wait()
    killed = root / f"microvllm-dp-{gone.pid}-x1y2z3"
    killed.mkdir()
    (killed / "input").write_text("")
    folder = make_tiny_model(root / "llama", "llama", seed=5)
    events_port = free_port()
    while not _port_free(events_port + 1):
        events_port = free_port()
    config = f'{{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:{events_port}", "topic": "kv"}}'
    server = Server(folder, root / "server.log", env={"TMPDIR": str(root)},
                    flags=[*SETTINGS, "--data-parallel-size", "2", "--kv-events-config", config])
    try:
        wait_for(server.healthy, STARTUP_TIMEOUT, "the data-parallel server's /health")
        yield DPServer(server, server.url, server.folder, events_port, root, killed)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def complete(url: str, model: str, prompt: str, max_tokens: int = 10) -> dict:
    response = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def test_two_cores_serve_the_same_text_as_one_engine_and_share_the_load(dp_server):
    prompts = [f"request {i}: the block table maps logical blocks to physical ones" for i in range(8)]
    before = per_engine(dp_server.url, "request_success_total")

    async def send_all():
        async with httpx.AsyncClient(timeout=120) as client:
            responses = await asyncio.gather(*[client.post(dp_server.url + "/v1/completions", json={
                "model": dp_server.folder, "prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
                for p in prompts])
        return [r.json()["choices"][0]["text"] for r in responses]

    texts = asyncio.run(send_all())
    reference = LLM(dp_server.folder, **LLM_SETTINGS)
    from microvllm import SamplingParams
    want = [o.outputs[0].text for o in reference.generate(
        prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)]
    assert texts == want
    after = per_engine(dp_server.url, "request_success_total")
    served = {engine: after[engine] - before.get(engine, 0.0) for engine in after}
    assert set(served) == {"0", "1"} and sum(served.values()) == 8
    assert min(served.values()) >= 2, f"8 requests at once, one core got almost all of them: {served}"


def test_a_cancelled_stream_frees_its_blocks_on_its_core(dp_server):
    with httpx.stream("POST", dp_server.url + "/v1/completions", timeout=60, json={
            "model": dp_server.folder, "prompt": "a long story about paged attention", "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 3:
                break   # the client goes away mid-stream
    wait_for(lambda: all(v == 0 for v in per_engine(dp_server.url, "kv_cache_usage_perc").values())
             and all(v == 0 for v in per_engine(dp_server.url, "num_requests_running").values()),
             30, "every core's KV cache to be free again")
    assert complete(dp_server.url, dp_server.folder, "still serving?")["choices"][0]["finish_reason"] == "length"


def test_a_killed_core_stops_the_server_and_no_process_is_left(tmp_path):
    folder = make_tiny_model(tmp_path / "llama", "llama", seed=5)
    server = Server(folder, tmp_path / "server.log", flags=[*SETTINGS, "--data-parallel-size", "2"])
    try:
        wait_for(server.healthy, STARTUP_TIMEOUT, "the data-parallel server's /health")
        cores = wait_for(lambda: len(core_pids(server.process.pid)) >= 2 and core_pids(server.process.pid),
                         30, "two engine-core processes")
        assert len(cores) == 2
        os.kill(cores[0], signal.SIGKILL)
        started = time.monotonic()
        wait_for(lambda: server.process.poll() is not None, 60, "the server to exit after a core died")
        assert server.process.returncode == 1, "a dead engine core: exit status 1, so a supervisor restarts it"
        assert time.monotonic() - started < 30
        wait_for(lambda: not any(alive(p) for p in cores), 30, "the other core to exit too")
    finally:
        server.stop()


def test_data_parallel_size_offline_is_refused_with_what_to_do(tmp_path):
    folder = make_tiny_model(tmp_path / "llama", "llama", seed=5)
    with pytest.raises(ValueError, match="--data-parallel-size N"):
        LLM(str(folder), data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(str(folder), data_parallel_size=0)


def test_a_request_a_core_refuses_is_a_400_with_the_cores_message(dp_server):
    """A request refused — by the API server's own checks or by the core that got it — is
    a 400 that says what to change, and the server goes on serving."""
    response = httpx.post(dp_server.url + "/v1/completions", timeout=60, json={
        "model": dp_server.folder, "prompt": "hello", "max_tokens": 2, "logprobs": 1000})
    assert response.status_code == 400, response.text
    assert "logprobs" in response.text
    too_long = httpx.post(dp_server.url + "/v1/completions", timeout=60, json={
        "model": dp_server.folder, "prompt": "word " * 5000, "max_tokens": 2})
    assert too_long.status_code == 400 and "max_model_len" in too_long.text, too_long.text


def test_each_core_publishes_its_kv_events_on_port_plus_its_rank(dp_server):
    """With KV events on, core r binds the endpoint's port + r (loopback: our default) and tags its batches with r:
    a router subscribes to each core as vLLM's routers subscribe to vLLM's DP ranks."""
    zmq = pytest.importorskip("zmq")
    import msgspec

    from microvllm.distributed.kv_events import KVEventBatch

    port = dp_server.events_port
    context = zmq.Context()
    try:
        subs = []
        for rank in range(2):
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            sub.setsockopt(zmq.RCVTIMEO, 200)
            sub.connect(f"tcp://127.0.0.1:{port + rank}")
            subs.append(sub)
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        ranks_seen: dict[int, set] = {0: set(), 1: set()}

        def both_cores_published() -> bool:
            # Slow joiners miss the first batches: keep sending prompts until each core's arrive.
            complete(dp_server.url, dp_server.folder, "tell me about block " + "hashes " * 20, max_tokens=2)
            for rank, sub in enumerate(subs):
                try:
                    while True:
                        _, _, payload = sub.recv_multipart()
                        ranks_seen[rank].add(decoder.decode(payload).data_parallel_rank)
                except zmq.Again:
                    pass
            return all(ranks_seen.values())

        wait_for(both_cores_published, 60, "KV event batches from both cores", interval=0.2)
        assert ranks_seen == {0: {0}, 1: {1}}, ranks_seen
    finally:
        context.destroy(linger=0)


def _port_free(port: int) -> bool:
    import socket
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_stale_socket_folders_of_dead_servers_are_removed_and_no_other(tmp_path):
    from microvllm.engine.ipc_dirs import remove_stale_socket_dirs

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f"microvllm-dp-{gone.pid}-abc123"
    live = tmp_path / f"microvllm-dp-{os.getpid()}-def456"
    legacy = tmp_path / "microvllm-dp-k2j3h4"   # an older version's name: no pid, left alone
    for folder in (stale, live, legacy):
        folder.mkdir()
        (folder / "input").write_text("")
    assert remove_stale_socket_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and legacy.exists()


def test_a_killed_servers_socket_folder_is_removed_at_the_next_start(dp_server):
    """The API server's IPC socket folder is ``microvllm-dp-<pid>-*``; one left by a server
    killed with -9 (its pid dead) is removed by the next one to start."""
    assert not dp_server.killed.exists(), "the dead server's folder is removed at start"
    own = [p.name for p in dp_server.root.glob(f"microvllm-dp-{dp_server.server.process.pid}-*")]
    assert len(own) == 1 and (dp_server.root / own[0] / "input").is_socket(), own


# ---------------------------------------------------------------- last: it stops the shared server
def test_sigterm_stops_the_cores_and_removes_the_socket_folder(dp_server):
    server = dp_server.server
    cores = core_pids(server.process.pid)
    assert len(cores) == 2 and complete(dp_server.url, dp_server.folder, "hello", max_tokens=2)["choices"]
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0
    wait_for(lambda: not any(alive(p) for p in cores), 30, "the engine cores to exit after SIGTERM")
    assert not list(dp_server.root.glob("microvllm-dp-*")), list(dp_server.root.iterdir())
