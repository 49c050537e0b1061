"""Prefill/decode disaggregation on loopback (``P2PConnector``): two ``microvllm serve``
processes, a prefill (kv_producer) and a decode (kv_consumer) instance, behind the real
``vllm-router --vllm-pd-disaggregation --kv-connector nixl``, against one colocated
server; and the faults, each on real processes::

    client ──> vllm-router ──> prefill (max_tokens 1, do_remote_decode) ── kv_transfer_params
                          └──> decode (do_remote_prefill: reads the blocks over TCP)

Block usage is read from each server's ``vllm:kv_cache_usage_perc`` (blocks held by
requests, delayed frees included); every wait is a poll against a deadline; every
process is killed by the fixture.
"""

import json
import signal
import socket
import subprocess
import threading

import httpx
import pytest

from microvllm.bench.pd import p2p_flags, pd_router_command
from microvllm.models.tiny import make_tiny_model
from tests.entrypoints.test_openai_server import SETTINGS, Server, free_port, wait_for
from tests.entrypoints.test_vllm_router import ROUTER

pytestmark = [pytest.mark.multiprocess]

SEND_TIMEOUT_S = 4.0
PROMPTS = ["The quick brown fox jumps over the lazy dog and then runs far away into the forest "
           "where nobody can find it again, ever.",
           "one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
           "fifteen sixteen seventeen eighteen nineteen twenty",
           "short prompt",
           "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
           "incididunt ut labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud"]


def transfer_flags(role: str, **extra) -> list[str]:
    return [*SETTINGS, *p2p_flags(role, **extra)]


def usage(server: Server) -> float:
    return server.metrics().get("kv_cache_usage_perc", 0.0)


def complete(url: str, model: str, prompt: str, max_tokens: int = 8, timeout: float = 60, **extra) -> dict:
    response = httpx.post(url + "/v1/completions", timeout=timeout, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    folder = make_tiny_model(root / "model", "llama", seed=3)
    servers = {
        "prefill": Server(folder, root / "prefill.log", transfer_flags("kv_producer", send_timeout_s=SEND_TIMEOUT_S)),
        "decode": Server(folder, root / "decode.log", transfer_flags("kv_consumer", load_timeout_s=3)),
        "colocated": Server(folder, root / "colocated.log"),
    }
    router = None
    try:
        for server in servers.values():
            wait_for(server.healthy, 180, "a server to start")
        port = free_port()
        log = open(root / "router.log", "w")
        router = subprocess.Popen(pd_router_command(ROUTER, port, servers["prefill"].url, servers["decode"].url),
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"

        def router_up() -> bool:
            assert router is not None and router.poll() is None, (root / "router.log").read_text()
            try:
                return httpx.get(url + "/health", timeout=3).status_code == 200
            except httpx.HTTPError:
                return False
        if __import__("pathlib").Path(ROUTER).is_file():
            wait_for(router_up, 60, "vllm-router to start")
        yield str(folder), servers, url
    finally:
        if router is not None and router.poll() is None:
            router.send_signal(signal.SIGKILL)
            router.wait(10)
        for server in servers.values():
            server.stop()


def prefill(servers, model: str, prompt: str) -> dict:
    """The router's first leg, as vllm-router sends it: max_tokens 1, do_remote_decode."""
    body = complete(servers["prefill"].url, model, prompt, max_tokens=1, min_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    params = body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    return params


@pytest.mark.skipif(not __import__("pathlib").Path(ROUTER).is_file(), reason="vllm-router is not installed")
def test_vllm_router_drives_the_pair_with_the_colocated_tokens(cluster):
    model, servers, url = cluster
    hits_before = servers["decode"].metrics().get("prefix_cache_hits_total", 0)
    for prompt in PROMPTS:
        want = complete(servers["colocated"].url, model, prompt, max_tokens=12)["choices"][0]["text"]
        got = complete(url, model, prompt, max_tokens=12)["choices"][0]["text"]
        assert got == want, prompt
    # Chat, streamed at the decode side (the router streams only the second leg).
    messages = [{"role": "user", "content": PROMPTS[0]}]
    want = httpx.post(servers["colocated"].url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": messages, "max_tokens": 10, "temperature": 0}).json()
    got = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": messages, "max_tokens": 10, "temperature": 0}).json()
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    # The decode side read the prompts' blocks (they are its prefix hits) ...
    assert servers["decode"].metrics()["prefix_cache_hits_total"] - hits_before >= 3 * 16
    # ... and the prefill side freed them once read, well before its timeout.
    wait_for(lambda: usage(servers["prefill"]) == 0.0, SEND_TIMEOUT_S - 1, "the prefill side to free its blocks")
    wait_for(lambda: usage(servers["decode"]) == 0.0, 10, "the decode side to free its blocks")


def test_a_failed_load_recomputes_the_prompt_with_the_same_tokens(cluster):
    model, servers, _ = cluster
    prompt = PROMPTS[3]
    want = complete(servers["colocated"].url, model, prompt)["choices"][0]["text"]
    params = prefill(servers, model, prompt)
    closed = free_port()   # nobody listens there: the load is refused
    got = complete(servers["decode"].url, model, prompt, kv_transfer_params={**params, "remote_port": closed})
    assert got["choices"][0]["text"] == want
    wait_for(lambda: usage(servers["decode"]) == 0.0, 10, "the decode side to free its blocks")


def test_a_restarted_producer_is_noticed_and_the_prompt_recomputed(cluster):
    """A producer that restarted has a new engine id: it refuses the read; the decode side
    computes the prompt. The old blocks (here: the request's, still held) go on the timeout."""
    model, servers, _ = cluster
    prompt = "a prompt no other test sends, so that the decode side has none of its blocks cached itself"
    want = complete(servers["colocated"].url, model, prompt)["choices"][0]["text"]
    params = prefill(servers, model, prompt)
    hits_before = servers["decode"].metrics().get("prefix_cache_hits_total", 0)
    got = complete(servers["decode"].url, model, prompt,
                   kv_transfer_params={**params, "remote_engine_id": "an-engine-before-the-restart"})
    assert got["choices"][0]["text"] == want
    # Computed, not loaded: the read was refused (a load would count as prefix hits).
    assert servers["decode"].metrics().get("prefix_cache_hits_total", 0) == hits_before
    wait_for(lambda: usage(servers["prefill"]) == 0.0, SEND_TIMEOUT_S + 10, "the prefill side's timeout")


def test_a_decode_instance_that_dies_mid_transfer_frees_the_producers_blocks(cluster):
    """A reader that asks for the blocks, takes a few bytes and vanishes (a decode process
    killed mid-transfer): the producer frees the blocks on its timeout, not never."""
    model, servers, _ = cluster
    params = prefill(servers, model, PROMPTS[0])
    assert usage(servers["prefill"]) > 0.0
    with socket.create_connection((params["remote_host"], params["remote_port"]), timeout=10) as sock:
        data = json.dumps({"op": "read", "engine_id": params["remote_engine_id"],
                           "request_id": params["remote_request_id"],
                           "block_ids": params["remote_block_ids"]}).encode()
        sock.sendall(len(data).to_bytes(4, "little") + data)
        sock.recv(64)
    assert usage(servers["prefill"]) > 0.0   # not freed by a read that never finished
    wait_for(lambda: usage(servers["prefill"]) == 0.0, SEND_TIMEOUT_S + 10, "the prefill side's timeout")


def test_an_abort_during_the_transfer_frees_both_sides(cluster):
    """The decode side's request is aborted (its client leaves) while its blocks are being
    read from a producer that stalls: once the read ends (here: the load timeout) the
    decode side frees them, and its next requests run; the producer frees its own on its
    timeout (the read never acknowledged)."""
    model, servers, _ = cluster
    params = prefill(servers, model, PROMPTS[2] + " " + PROMPTS[0])
    stalled = socket.socket()
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(4)
    accepted = []

    def accept() -> None:
        try:
            accepted.append(stalled.accept()[0])   # takes the read, answers nothing
        except OSError:
            pass
    threading.Thread(target=accept, daemon=True).start()
    try:
        with pytest.raises(httpx.ReadTimeout):
            complete(servers["decode"].url, model, PROMPTS[2] + " " + PROMPTS[0], timeout=1.0,
                     kv_transfer_params={**params, "remote_port": stalled.getsockname()[1]})
        assert accepted, "the decode side never started reading"
        assert usage(servers["decode"]) > 0.0   # held while the read may still write them
        wait_for(lambda: usage(servers["decode"]) == 0.0, 15, "the decode side to free the aborted blocks")
        wait_for(lambda: usage(servers["prefill"]) == 0.0, SEND_TIMEOUT_S + 10, "the prefill side's timeout")
        want = complete(servers["colocated"].url, model, PROMPTS[0])["choices"][0]["text"]
        assert complete(servers["decode"].url, model, PROMPTS[0])["choices"][0]["text"] == want
    finally:
        for conn in accepted:
            conn.close()
        stalled.close()
