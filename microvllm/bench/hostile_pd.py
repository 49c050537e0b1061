"""``microvllm bench hostile`` (P/D part): a hostile client of a prefill/decode pair.

Starts a prefill instance (``kv_producer``, side channel on a fixed port), a decode
instance (``kv_consumer`` allowing that producer and one more port where this script plays
a fake producer) and a colocated server for reference, all on 127.0.0.1; keeps one greedy
chat stream running on the decode instance, and sends, one after another, what a client
of the pair can send:

    another prompt's params     prompt V with prompt W's kv_transfer_params (and V's digest)
    a listener of its own       kv_transfer_params naming a port where it answers random KV
    malformed params            wrong types, 500 block ids for a 3-block prompt, queued
    4 GiB length                a side-channel message that announces 4 GiB (x2)
    a trickling producer        an allowed producer that sends one byte a second
    unread prefills             40 prefill legs whose decode legs never come

For each: the answers, and the stream's largest and median gap while it ran. Then: whether
the decode instance answers the attacked prompts as the colocated server does (no poisoned
prefix cache), /health, each server's RSS before and after, the producer's held KV.

    python -m microvllm bench hostile --set pd [--model FOLDER] [--quick]
"""

from __future__ import annotations

import hashlib
import json
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from microvllm.bench.hostile import Server, Stream, send
from microvllm.testing import free_ports

VICTIM = ("I bought a kettle last week and it arrived broken, the handle came off on the first day and the "
          "lid does not close; can I have my money back, and how long does a refund take?")
SLOW = "(a prompt no other attack sends, so that the decode side has none of it) " + VICTIM
OTHER = "Which of these is a mammal: (a) a shark, (b) a dolphin, (c) a trout? Answer with the letter only."


def client_digest(token_ids: list[int], num_blocks: int, block_size: int = 16) -> str:
    """The digest any client can compute for any prompt: what a decode side once compared
    ``remote_prompt_digest`` with (it came from the request body, so it proved nothing)."""
    data = struct.pack(f"<{num_blocks * block_size}q", *token_ids[:num_blocks * block_size])
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def send_raw(sock: socket.socket, message: dict) -> None:
    """One side-channel control message: 4-byte little-endian length, then JSON."""
    data = json.dumps(message).encode()
    sock.sendall(len(data).to_bytes(4, "little") + data)


class FakeProducer:
    """A listener on 127.0.0.1:``port`` playing a producer: ``behaviour(sock, ask)`` answers
    each read it is sent (``accepted``: the connections it got; ``asks``: their messages)."""

    def __init__(self, port: int, behaviour: Callable[[socket.socket, dict], None]) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(8)
        self.accepted: list[socket.socket] = []
        self.asks: list[dict] = []    # what each connection asked ("read" or "release")
        self.behaviour = behaviour
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            size = int.from_bytes(conn.recv(4), "little")
            ask = json.loads(conn.recv(size))
            self.asks.append(ask)
            self.behaviour(conn, ask)
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


def forge_kv(conn: socket.socket, ask: dict) -> None:
    """A rogue producer: "ok", the asker's own digest back, then megabytes of random floats."""
    import os

    send_raw(conn, {"ok": True, "prompt_digest": ask.get("prompt_digest")})
    conn.sendall(os.urandom(8 << 20))


def trickle(conn: socket.socket, ask: dict) -> None:
    """A slow producer: it answers, then sends one byte a second for 40 s."""
    send_raw(conn, {"ok": True, "prompt_digest": ask.get("prompt_digest")})
    for _ in range(40):
        conn.sendall(b"\0")
        time.sleep(1.0)


class Pair:
    """The three servers, and the requests this bench sends them."""

    def __init__(self, model: str | None, logs: Path) -> None:
        self.side_channel, self.fake = free_ports(2)
        p2p = {"kv_connector": "P2PConnector"}
        producer = {**p2p, "kv_role": "kv_producer", "kv_connector_extra_config": {"port": self.side_channel}}
        consumer = {**p2p, "kv_role": "kv_consumer", "kv_connector_extra_config": {
            "allowed_producers": [f"127.0.0.1:{self.side_channel}", f"127.0.0.1:{self.fake}"],
            "load_timeout_s": 3}}
        common = ["--max-num-seqs", "8"]
        self.prefill = Server(model, [*common, "--kv-transfer-config", json.dumps(producer)],
                              logs / "microvllm-bench-hostile-prefill.log")
        self.decode = Server(model, [*common, "--kv-transfer-config", json.dumps(consumer)],
                             logs / "microvllm-bench-hostile-decode.log")
        self.colocated = Server(model, common, logs / "microvllm-bench-hostile-colocated.log")
        self.servers = (self.prefill, self.decode, self.colocated)

    def wait_healthy(self) -> None:
        for server in self.servers:
            server.wait_healthy()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def complete(self, server: Server, prompt: str, max_tokens: int = 16, **extra) -> tuple[int, dict]:
        import httpx

        response = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
        return response.status_code, response.json()

    def prefill_params(self, prompt: str) -> dict:
        status, body = self.complete(self.prefill, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        assert status == 200, body
        return body["kv_transfer_params"]

    def token_ids(self, prompt: str) -> list[int]:
        import httpx

        return httpx.post(self.colocated.url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]

    def same_as_colocated(self, prompt: str) -> bool:
        """The decode instance's greedy text for ``prompt`` (no kv_transfer_params) is the
        colocated server's: its prefix cache holds no foreign KV for it."""
        texts = [self.complete(server, prompt, max_tokens=24)[1]["choices"][0]["text"]
                 for server in (self.decode, self.colocated)]
        return texts[0] == texts[1]


def attacks(pair: Pair, quick: bool) -> list[tuple[str, Callable[[], str]]]:
    def another_prompts_params() -> str:
        params = pair.prefill_params(OTHER)
        forged = {**params, "remote_prompt_digest": client_digest(pair.token_ids(VICTIM),
                                                                  len(params["remote_block_ids"]))}
        status, _ = pair.complete(pair.decode, VICTIM, kv_transfer_params=forged)
        return f"{status}, victim unpoisoned: {pair.same_as_colocated(VICTIM)}"

    def own_listener() -> str:
        rogue_port = free_ports(1)[0]
        rogue = FakeProducer(rogue_port, forge_kv)
        try:
            params = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1, 2, 3, 4],
                      "remote_host": "127.0.0.1", "remote_port": rogue_port, "remote_request_id": "x"}
            status, _ = pair.complete(pair.decode, VICTIM + " again", kv_transfer_params=params)
            return f"{status}, connections to it: {len(rogue.accepted)}"
        finally:
            rogue.close()

    def malformed() -> str:
        statuses = [pair.complete(pair.decode, "hello", kv_transfer_params={"do_remote_prefill": True, **bad})[0]
                    for bad in ({"remote_block_ids": 5}, {"remote_port": "80"}, {"remote_host": "h" * 1000})]
        long_ids = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": list(range(500)),
                    "remote_host": "127.0.0.1", "remote_port": pair.side_channel, "remote_request_id": "x"}
        results: list[str] = []
        threads = [threading.Thread(target=lambda: results.append(str(pair.complete(
            pair.decode, OTHER + " " + OTHER, kv_transfer_params=long_ids)[0]))) for _ in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return f"{sorted(set(statuses))} then {sorted(set(results))}"

    def huge_length() -> str:
        closed = 0
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", pair.side_channel), timeout=10) as sock:
                sock.sendall((0xFFFF_FFF0).to_bytes(4, "little"))
                sock.settimeout(10)
                closed += sock.recv(16) == b""
        return f"{closed}/2 closed at once"

    def trickling() -> str:
        params = pair.prefill_params(SLOW)
        fake = FakeProducer(pair.fake, trickle)
        try:
            started = time.monotonic()
            status, _ = pair.complete(pair.decode, SLOW, kv_transfer_params={
                **params, "remote_port": pair.fake})
            return f"{status} after {time.monotonic() - started:.1f} s"
        finally:
            fake.close()

    def unread_prefills() -> str:
        held = [len(pair.prefill_params(f"{i} {OTHER} {VICTIM}")["remote_block_ids"])
                for i in range(10 if quick else 40)]
        return f"held {sum(held)} blocks, {held.count(0)} refused"

    return [("another prompt's params", another_prompts_params), ("a listener of the client's own", own_listener),
            ("malformed params (12 queued)", malformed), ("4 GiB length, twice", huge_length),
            ("a trickling producer", trickling), ("unread prefills", unread_prefills)]


def run(model: str | None, logs: Path, quick: bool) -> bool:
    """Run the P/D attacks (see the module docstring); True when nothing was poisoned, no
    server died, memory stayed within 10 % of its start and the stream's largest gap was
    under 1 s."""
    pair = Pair(model, logs)
    ok = True
    try:
        pair.wait_healthy()
        send(pair.decode.url, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                              "max_tokens": 8})
        reference = pair.complete(pair.decode, VICTIM, max_tokens=24)[1]["choices"][0]["text"]
        rss_start = {name: server.rss_mb() for name, server in (("prefill", pair.prefill), ("decode", pair.decode))}
        stream = Stream(pair.decode.url)
        time.sleep(3)
        print(f"{'P/D attack':34} {'answers':44} {'largest gap':>12} {'median gap':>11}")
        for name, attack in attacks(pair, quick):
            start = time.monotonic()
            answer = attack()
            gaps = stream.gaps_between(start, time.monotonic()) or [0.0]
            ok &= max(gaps) < 1.0
            print(f"{name:34} {answer[:44]:44} {max(gaps) * 1e3:10.0f} ms {statistics.median(gaps) * 1e3:8.0f} ms")
        stream.stop()
        import httpx

        health = {name: httpx.get(server.url + "/health", timeout=10).status_code
                  for name, server in (("prefill", pair.prefill), ("decode", pair.decode))}
        same = pair.complete(pair.decode, VICTIM, max_tokens=24)[1]["choices"][0]["text"] == reference
        unpoisoned = all(pair.same_as_colocated(p) for p in (VICTIM, VICTIM + " again", SLOW))
        rss_end = {name: server.rss_mb() for name, server in (("prefill", pair.prefill), ("decode", pair.decode))}
        growth = {name: rss_end[name] / rss_start[name] - 1 for name in rss_start}
        print(f"\nafter the P/D set: /health {health}; the decode side's greedy text as before: {same}; "
              f"attacked prompts answered as colocated: {unpoisoned}")
        print("RSS: " + ", ".join(f"{name} {rss_start[name]:.0f} -> {rss_end[name]:.0f} MB ({growth[name] * 100:+.1f}%)"
                                  for name in rss_start))
        ok &= same and unpoisoned and set(health.values()) == {200} and max(growth.values()) < 0.10
    finally:
        pair.stop()
    return ok

