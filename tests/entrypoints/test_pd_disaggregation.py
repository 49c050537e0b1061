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

import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from microvllm.bench.hostile_pd import FakeProducer, client_digest, forge_kv, send_raw, trickle
from microvllm.bench.pd import p2p_flags, pd_router_command
from microvllm.distributed.kv_transfer.kv_connector.p2p_protocol import prompt_digest
from microvllm.models.tiny import make_tiny_model
from microvllm.testing import free_ports
from tests.support import ROUTER, SETTINGS, Server, free_port, wait_for

pytestmark = [pytest.mark.multiprocess]

MAX_HELD_BLOCKS = 24

SEND_TIMEOUT_S = 8.0
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
    response = post(url, model, prompt, max_tokens, timeout, **extra)
    assert response.status_code == 200, response.text
    return response.json()


def post(url: str, model: str, prompt: str, max_tokens: int = 8, timeout: float = 60, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=timeout, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})


@dataclass
class Cluster:
    model: str
    servers: dict[str, Server]
    url: str                  # vllm-router in front of the pair
    side_channel: int         # the producer's side-channel port (allowed by the decode side)
    closed: int               # allowed by the decode side, nobody listens there
    fake: int                 # allowed by the decode side: tests run fake producers on it

    def __iter__(self):       # model, servers, url = cluster
        return iter((self.model, self.servers, self.url))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    folder = make_tiny_model(root / "model", "llama", seed=3)
    side_channel, closed, fake = free_ports(3)
    allowed = [f"127.0.0.1:{port}" for port in (side_channel, closed, fake)]
    servers = {
        "prefill": Server(folder, root / "prefill.log", transfer_flags(
            "kv_producer", port=side_channel, send_timeout_s=SEND_TIMEOUT_S, max_held_blocks=MAX_HELD_BLOCKS)),
        # max_num_seqs 2: a third request waits in the queue (its KV load starts after a step)
        "decode": Server(folder, root / "decode.log", [*transfer_flags(
            "kv_consumer", load_timeout_s=3, allowed_producers=allowed), "--max-num-seqs", "2"]),
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
        yield Cluster(str(folder), servers, url, side_channel, closed, fake)
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
    prompt = "failed load: " + PROMPTS[3]   # its own first block: nothing of it cached at the decode side
    want = complete(servers["colocated"].url, model, prompt)["choices"][0]["text"]
    params = prefill(servers, model, prompt)
    # An allowed producer address where nobody listens: the load is refused.
    got = complete(servers["decode"].url, model, prompt, kv_transfer_params={**params, "remote_port": cluster.closed})
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
    count = len(params["remote_block_ids"])
    with socket.create_connection((params["remote_host"], params["remote_port"]), timeout=10) as sock:
        send_raw(sock, {"op": "read", "engine_id": params["remote_engine_id"],
                        "request_id": params["remote_request_id"], "first": 0, "count": count,
                        "prompt_digest": prompt_digest(token_ids(servers, model, PROMPTS[0]), count, 16)})
        assert b'"ok": true' in sock.recv(64)   # a well-formed read: the producer starts sending
    assert usage(servers["prefill"]) > 0.0   # not freed by a read that never finished
    wait_for(lambda: usage(servers["prefill"]) == 0.0, SEND_TIMEOUT_S + 10, "the prefill side's timeout")


def token_ids(servers, model: str, prompt: str) -> list[int]:
    response = httpx.post(servers["colocated"].url + "/tokenize", json={"model": model, "prompt": prompt}, timeout=30)
    return response.json()["tokens"]


def test_an_abort_during_the_transfer_frees_both_sides(cluster):
    """The decode side's request is aborted (its client leaves) while its blocks are being
    read from a producer that stalls: once the read ends (here: the load timeout) the
    decode side frees them, and its next requests run; the producer frees its own on its
    timeout (the read never acknowledged)."""
    model, servers, _ = cluster
    params = prefill(servers, model, PROMPTS[2] + " " + PROMPTS[0])
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    stalled.bind(("127.0.0.1", cluster.fake))   # a producer the decode side allows, gone silent
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
                     kv_transfer_params={**params, "remote_port": cluster.fake})
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


# ---------------------------------------------------------------- hostile clients
# Each attack below once worked against this pair (a poisoned prefix cache, a dead decode
# server, gigabytes allocated, a request held for minutes); each test failed before its fix.
REFUND = ("I bought a kettle last week and it arrived broken, the handle came off on the first day "
          "and the lid does not close; can I have my money back, and how long does a refund take?")
OTHER = ("Which of these is a mammal: (a) a shark, (b) a dolphin, (c) a trout, (d) an eel? Answer "
         "with the letter only.")


def assert_decode_side_answers_like_colocated(cluster, prompt: str) -> None:
    """A plain request for ``prompt`` (its blocks now cached at the decode side, if any were
    loaded) gets the colocated server's greedy text: the cache holds no foreign KV."""
    want = complete(cluster.servers["colocated"].url, cluster.model, prompt, max_tokens=12)["choices"][0]["text"]
    got = complete(cluster.servers["decode"].url, cluster.model, prompt, max_tokens=12)["choices"][0]["text"]
    assert got == want, "the decode side's prefix cache holds another prompt's KV"


def test_another_prompts_kv_never_enters_the_decode_cache(cluster):
    """Prompt V sent with the kv_transfer_params of another prompt W (and V's own digest, as
    a client computes it): the producer compares the digest of the tokens IT prefilled and
    refuses; the decode side computes V. Asked directly, the producer refuses too."""
    model, servers, _ = cluster
    victim = REFUND + " (order 5521)"
    params = prefill(servers, model, OTHER)
    ids = token_ids(servers, model, victim)
    count = len(params["remote_block_ids"])
    assert len(ids) > count * 16, "the victim prompt must be longer than the other one"
    forged = {**params, "remote_prompt_digest": client_digest(ids, count)}
    got = complete(servers["decode"].url, model, victim, max_tokens=12, kv_transfer_params=forged)
    want = complete(servers["colocated"].url, model, victim, max_tokens=12)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert_decode_side_answers_like_colocated(cluster, victim)
    # The producer's own check, on the wire: a read with the victim's digest is refused.
    with socket.create_connection(("127.0.0.1", cluster.side_channel), timeout=10) as sock:
        other = prefill(servers, model, OTHER + " and again: " + OTHER)
        send_raw(sock, {"op": "read", "engine_id": other["remote_engine_id"], "request_id": other["remote_request_id"],
                        "first": 0, "count": 2, "prompt_digest": prompt_digest(ids, 2, 16)})
        answer = sock.recv(4096)
    assert b'"ok": false' in answer and b"not the one this engine prefilled" in answer


def test_a_producer_the_operator_did_not_name_is_never_contacted(cluster):
    """kv_transfer_params pointing at a listener of the client's own (answering "ok" and
    random floats), at another port, or at the producer under another name: a 400 that
    names allowed_producers, and no connection is made (no port scan, no forged KV)."""
    model, servers, _ = cluster
    victim = REFUND + " (order 7788)"
    ids = token_ids(servers, model, victim)

    rogue_port = free_port()
    rogue = FakeProducer(rogue_port, forge_kv)
    try:
        for host, port in (("127.0.0.1", rogue_port), ("localhost", cluster.side_channel),
                           ("127.0.0.5", cluster.side_channel)):
            params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "rogue",
                      "remote_block_ids": [1, 2, 3, 4], "remote_host": host, "remote_port": port,
                      "remote_request_id": "x", "remote_prompt_digest": client_digest(ids, 4)}
            response = post(servers["decode"].url, model, victim, kv_transfer_params=params)
            assert response.status_code == 400, response.text
            assert "allowed_producers" in response.json()["error"]["message"]
        assert not rogue.accepted, "the decode side connected where a client told it to"
    finally:
        rogue.close()
    assert_decode_side_answers_like_colocated(cluster, victim)


def test_malformed_kv_transfer_params_fail_alone_and_the_server_lives(cluster):
    """remote_block_ids of the wrong type: a 400 naming the field. remote_block_ids longer
    than the prompt's blocks, sent while the decode side is full (max_num_seqs 2: the
    request waits, its connector call runs after a step): that request alone is served
    (computed), the two running streams finish, /health stays 200."""
    model, servers, _ = cluster
    decode = servers["decode"].url
    results: list[int] = []
    started = [threading.Event() for _ in range(2)]

    def long_stream(index: int) -> None:
        # Streamed: its first chunk says it runs (a core in its own process decodes 400 tokens
        # of this model in well under a second: polling /metrics for "two running" raced it).
        with httpx.stream("POST", decode + "/v1/completions", timeout=120, json={
                "model": model, "prompt": PROMPTS[1], "max_tokens": 900, "temperature": 0,
                "ignore_eos": True, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    started[index].set()
            results.append(response.status_code)
        started[index].set()
    streams = [threading.Thread(target=long_stream, args=(i,)) for i in range(2)]
    for thread in streams:
        thread.start()
    assert all(event.wait(30) for event in started), "two running streams"
    prompt = PROMPTS[0] + " once more, with feeling"
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
              "remote_block_ids": list(range(500)), "remote_host": "127.0.0.1", "remote_port": cluster.closed,
              "remote_request_id": "x"}
    got = complete(decode, model, prompt, kv_transfer_params=params)
    for thread in streams:
        thread.join(120)
    assert results == [200, 200]
    assert got["choices"][0]["text"] == complete(servers["colocated"].url, model, prompt)["choices"][0]["text"]
    assert servers["decode"].healthy()
    for bad, field in (({"remote_block_ids": 5}, "remote_block_ids"), ({"remote_port": "80"}, "remote_port"),
                       ({"remote_host": "h" * 1000}, "remote_host"), ({"surprise": 1}, "unknown key")):
        response = post(decode, model, "short prompt", kv_transfer_params={"do_remote_prefill": True, **bad})
        assert response.status_code == 400 and field in response.json()["error"]["message"], response.text


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_a_peer_chosen_length_never_allocates(cluster):
    """A side-channel message announcing 4 GiB: refused at once, nothing allocated."""
    _, servers, _ = cluster
    pid = servers["prefill"].process.pid
    before = rss_mb(pid)
    with socket.create_connection(("127.0.0.1", cluster.side_channel), timeout=10) as sock:
        sock.sendall((0xFFFF_FFF0).to_bytes(4, "little"))
        sock.settimeout(6)
        assert sock.recv(16) == b""   # closed by the producer, not waited on
    assert rss_mb(pid) - before < 64, f"RSS {before:.0f} -> {rss_mb(pid):.0f} MB"
    assert servers["prefill"].healthy()


def test_a_trickling_producer_is_cut_off_at_the_load_deadline(cluster):
    """An allowed producer that answers, then sends one byte a second: the load ends at its
    deadline (load_timeout_s 3, the whole load), and the request is computed."""
    model, servers, _ = cluster
    prompt = "trickle: " + PROMPTS[3]   # its own first block: the decode side has none of it cached
    params = prefill(servers, model, prompt)

    fake = FakeProducer(cluster.fake, trickle)
    answers: list[dict] = []
    try:
        started = time.monotonic()
        request = threading.Thread(target=lambda: answers.append(complete(
            servers["decode"].url, model, prompt, timeout=90,
            kv_transfer_params={**params, "remote_port": cluster.fake})))
        request.start()
        # Loading its KV (from the moment the fake producer is asked, for up to the 3 s deadline),
        # the request is waiting, as vLLM counts it: a router sees a busy server, not an idle one.
        wait_for(lambda: any(ask.get("op") == "read" for ask in fake.asks), 60, "the decode side to start loading")
        wait_for(lambda: servers["decode"].metrics().get("num_requests_waiting", 0) >= 1, 2.5, "a loading request")
        request.join(90)
        took = time.monotonic() - started
        got = answers[0]
    finally:
        fake.close()
    assert took < 3 + 5, f"the load took {took:.0f} s (its deadline is 3 s)"
    assert got["choices"][0]["text"] == complete(servers["colocated"].url, model, prompt)["choices"][0]["text"]


def test_a_refused_decode_leg_frees_the_producers_blocks_at_once(cluster):
    """The decode side refuses the decode leg (a 400 for another field): it tells the
    producer, which frees the prompt's blocks now, not after send_timeout_s."""
    model, servers, _ = cluster
    wait_for(lambda: usage(servers["prefill"]) == 0.0, SEND_TIMEOUT_S + 10, "earlier tests' holds to end")
    prompt = PROMPTS[1] + " refused"
    params = prefill(servers, model, prompt)
    assert usage(servers["prefill"]) > 0.0
    response = post(servers["decode"].url, model, prompt, kv_transfer_params=params, allowed_token_ids=[10**9])
    assert response.status_code == 400, response.text
    wait_for(lambda: usage(servers["prefill"]) == 0.0, SEND_TIMEOUT_S / 2, "the producer to free the blocks")


def test_the_producer_holds_at_most_max_held_blocks_for_remote_decodes(cluster):
    """Prefill legs whose decode legs never come: past max_held_blocks the producer keeps
    nothing (its answer lists no blocks: the decode side would compute the prompt)."""
    model, servers, _ = cluster
    wait_for(lambda: usage(servers["prefill"]) == 0.0, SEND_TIMEOUT_S + 10, "earlier tests' holds to end")
    held = []
    for i in range(8):
        body = complete(servers["prefill"].url, model, f"{i} " + PROMPTS[0] + " " + PROMPTS[3], max_tokens=1,
                        kv_transfer_params={"do_remote_decode": True})
        held.append(len(body["kv_transfer_params"]["remote_block_ids"]))
    assert sum(held) <= MAX_HELD_BLOCKS and 0 in held, held
    wait_for(lambda: usage(servers["prefill"]) == 0.0, SEND_TIMEOUT_S + 10, "the prefill side's timeout")
