"""``microvllm serve`` with KV events on, as a hostile client on the network sees it: the
events carry every prompt's token ids, so with vLLM's own config (no endpoint given) the
publisher must bind 127.0.0.1 only, as the HTTP API does (vLLM binds ``tcp://*:5557``)."""

import re
import socket

import pytest

from microvllm.bench.hostile_events_tier import listening_addresses
from microvllm.models.tiny import make_tiny_model
from tests.support import SETTINGS, STARTUP_TIMEOUT, Server, wait_for

pytestmark = pytest.mark.multiprocess

DEFAULT_PORT = 5557


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return bool(listening_addresses(port))


def test_serve_with_the_default_kv_events_endpoint_listens_on_loopback_only(tmp_path):
    zmq = pytest.importorskip("zmq")
    if port_taken(DEFAULT_PORT):
        pytest.skip(f"port {DEFAULT_PORT} (the default KV events endpoint) is in use on this machine")
    folder = make_tiny_model(tmp_path / "llama", "llama", seed=5)
    server = Server(folder, tmp_path / "server.log", flags=[
        *SETTINGS, "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}'])
    context = zmq.Context()
    try:
        wait_for(server.healthy, STARTUP_TIMEOUT, "the server's /health")
        assert listening_addresses(DEFAULT_PORT) == {"127.0.0.1"}, listening_addresses(DEFAULT_PORT)
        assert listening_addresses(server.port) == {"127.0.0.1"}
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 200)
        sub.connect(f"tcp://127.0.0.1:{DEFAULT_PORT}")
        import httpx

        sent = []

        def a_batch_arrived() -> bool:   # the slow joiner misses the first ones: send until one arrives
            sent.append(1)               # a new prompt each time: a cached one stores no block
            httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": server.folder, "prompt": f"{len(sent)} hashes " * 40, "max_tokens": 1, "temperature": 0})
            try:
                return len(sub.recv_multipart()) == 3
            except zmq.Again:
                return False

        wait_for(a_batch_arrived, 60, "a KV event batch on tcp://127.0.0.1:5557", interval=0.1)
        assert "every network interface" not in server.log_path.read_text()
    finally:
        context.destroy(linger=0)
        server.stop()


def test_the_hostile_events_and_tier_bench_passes_on_the_tiny_model(tmp_path, capsys):
    """``python -m microvllm.bench.hostile_events_tier --quick`` on the tiny model: nobody
    outside loopback reaches the sockets, a replay of everything gets at most the cap, and
    filling the file tier past its capacity costs the stream nothing and kills nothing."""
    pytest.importorskip("zmq")
    from microvllm.bench.hostile_events_tier import run
    from microvllm.distributed.kv_events import REPLAY_MAX_BATCHES

    folder = make_tiny_model(tmp_path / "llama", "llama", seed=5)
    assert run(str(folder), tmp_path / "logs", quick=True)
    out = capsys.readouterr().out
    assert "OPEN" not in out and "greedy text as before the set: True" in out
    replayed = [int(n) for n in re.findall(r"(\d+) batches", out)]
    assert replayed and max(replayed) <= REPLAY_MAX_BATCHES
