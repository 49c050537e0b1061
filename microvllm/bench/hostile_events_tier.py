"""What a hostile client gets from the KV events sockets and the file-backed KV tier, and
what its attacks cost the other clients, measured.

Starts ``microvllm serve`` (the embedded model unless ``--model``) with KV events on
(PUB and replay on loopback) and the ``OffloadingConnector``'s file tier: on a 32 MB
tmpfs when run as root (else a file in a temporary folder). One greedy stream runs
throughout as a well-behaved client; then, one after another:

- a connection to the events and replay ports from a non-loopback address of this
  machine (only its own addresses: nothing leaves it), which must be refused;
- replay requests asking for everything (start seq 0), which must get at most the cap;
- malformed replay requests;
- many distinct long prompts, which fill the tier past its capacity (its LRU must
  evict; before the fix, a sparse file on a small filesystem died of SIGBUS).

For each: the answers and the stream's largest and median gap between two tokens of one
response (the table of ``microvllm bench hostile``; a new response's first token waits
behind the long prompts' prefill, which is queueing, not counted); then whether the
server lives, gives the same greedy text and its resident memory before and after. As
root, last, a second server whose tier is larger than its filesystem must refuse to
start with a message that says what to change.

    python -m microvllm bench hostile --set events-tier [--model FOLDER] [--quick]

Figures depend on the machine: run it with nothing else running.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from microvllm.bench.hostile import Server, Stream, send
from microvllm.distributed.kv_events import REPLAY_MAX_BATCHES
from microvllm.testing import free_ports

TMPFS_MB = 32
TIER_BLOCKS = 16          # the embedded model's 16-token blocks: about 12 MB in float32
BATCHED_TOKENS = 128      # a long prompt's prefill in chunks: the stream's steps stay short
NUM_KV_BLOCKS = 160       # a pool the warm-up cycles through: every page touched before RSS is taken


def listening_addresses(port: int) -> set[str]:
    """The local addresses a TCP socket listens on for ``port`` (/proc/net/tcp, tcp6): which
    interfaces could reach it, read without sending a packet anywhere."""
    import ipaddress

    found = set()
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] != "0A" or int(hex_port, 16) != port:   # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))   # each 32-bit word is host-order
            found.add(str(ipaddress.ip_address(raw)))
    return found


def exposure(ports: list[int]) -> list[str]:
    """Where each event socket listens: "loopback" when only 127.x / ::1 can reach it."""
    results = []
    for port in ports:
        addresses = listening_addresses(port)
        local = all(a.startswith("127.") or a == "::1" for a in addresses)
        results.append("loopback only" if addresses and local else f"{port} on {sorted(addresses)}")
    return results


def replay_everything(replay_endpoint: str, count: int) -> list[str]:
    """``count`` DEALER clients each ask for every batch from seq 0; each answer's size."""
    import zmq

    context = zmq.Context()
    sockets = []
    try:
        for _ in range(count):
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVTIMEO, 10_000)
            dealer.connect(replay_endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            sockets.append(dealer)
        results = []
        for dealer in sockets:
            got = 0
            try:
                while True:
                    _, seq, _ = dealer.recv_multipart()
                    if int.from_bytes(seq, "big", signed=True) == -1:
                        break
                    got += 1
                results.append(f"{got} batches")
            except zmq.Again:
                results.append("no end marker")
        return results
    finally:
        context.destroy(linger=0)


def malformed_replays(replay_endpoint: str, count: int) -> list[str]:
    """``count`` requests of the wrong shape, then one good one: is it still answered?"""
    import zmq

    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(replay_endpoint)
        for i in range(count):
            dealer.send_multipart([b"", b"x" * (i % 50 + 9), b"extra"] if i % 2 else [b"garbage" * (i % 7)])
        dealer.send_multipart([b"", (2 ** 62).to_bytes(8, "big")])   # past every seq: only the end marker
        while True:
            try:
                _, seq, _ = dealer.recv_multipart()
            except zmq.Again:
                return ["no answer after them"]
            if int.from_bytes(seq, "big", signed=True) == -1:
                return ["answered after them"]
    finally:
        context.destroy(linger=0)


def long_text(index: int, salt: str, num_words: int) -> str:
    words = ["lighthouse", "harbour", "keeper", "storm", "lantern", "tide", "gull", "rock", "signal", "night"]
    return f"{salt} {index}: " + " ".join(f"{words[(index * 7 + j * 3) % 10]}{(index * 131 + j) % 997}"
                                          for j in range(num_words))


def words_per_prompt(url: str, target_tokens: int = 1000) -> int:
    """How many words make a prompt of about ``target_tokens`` (at most 60 % of the
    server's max_model_len), measured with the server's own /tokenize."""
    import httpx

    sample = long_text(0, "sample", 100)
    answer = httpx.post(url + "/tokenize", json={"prompt": sample}, timeout=60).json()
    target = min(target_tokens, int(0.6 * answer["max_model_len"]))
    return max(10, int(100 * target / max(1, answer["count"])))


def long_prompts(count: int, salt: str, num_words: int) -> list[tuple[str, str, dict]]:
    """Distinct long prompts, one token each: every one adds new blocks."""
    return [("POST", "/v1/completions", {"prompt": long_text(i, salt, num_words), "max_tokens": 1,
                                         "temperature": 0}) for i in range(count)]


def in_batches(url: str, requests: list, at_once: int) -> list[str]:
    results: list[str] = []
    for start in range(0, len(requests), at_once):
        threads = [threading.Thread(target=lambda r=r: results.append(send(url, *r)))
                   for r in requests[start:start + at_once]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return [r.split(" in ")[0] for r in results]


def greedy_text(url: str) -> str:
    import httpx

    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24,
            "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]["content"]


def mount_small_fs(folder: Path, size_mb: int) -> bool:
    """A ``size_mb`` tmpfs at ``folder`` when root (False otherwise, or when mount fails)."""
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    return done.returncode == 0


def tier_config(path: Path, blocks: int) -> str:
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"num_cpu_blocks": blocks, "path": str(path)}})


def oversized_tier_refused(model: str | None, folder: Path, logs: Path) -> tuple[bool, str]:
    """A server whose tier is larger than its filesystem: it must exit with a message that
    says what to change (not start, and never die of SIGBUS later)."""
    log = logs / "microvllm-bench-hostile-events-tier-oversized.log"
    server = Server(model, ["--kv-transfer-config", tier_config(folder / "oversized.bin", 100_000)], log)
    try:
        status = server.process.wait(600)
    except subprocess.TimeoutExpired:
        return False, "still running after 600 s"
    finally:
        server.stop()
    text = log.read_text()
    clear = "num_cpu_blocks" in text and "filesystem" in text
    return status not in (0, -7) and clear, f"exit status {status}" + (", says what to change" if clear else "")


def run(model: str | None, logs: Path, quick: bool) -> bool:
    """Run the whole set; print the table; True when the server lived, gave the same greedy
    text, kept its memory within 10 % and the stream never waited 1 s for a token."""
    import httpx

    logs.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="mvtier", dir="/tmp"))
    small_fs = mount_small_fs(folder, TMPFS_MB)
    events_port, replay_port = free_ports(2)
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}
    flags = ["--max-num-seqs", "16", "--max-num-batched-tokens", str(BATCHED_TOKENS),
             "--num-kv-blocks", str(NUM_KV_BLOCKS),
             "--kv-events-config", json.dumps(events),
             "--kv-transfer-config", tier_config(folder / "tier.bin", TIER_BLOCKS)]
    where = f"a {TMPFS_MB} MB tmpfs" if small_fs else "a temporary folder (not root: no small filesystem)"
    print(f"KV events on 127.0.0.1:{events_port} (replay {replay_port}); file tier of {TIER_BLOCKS} blocks on {where}")
    server = Server(model, flags, logs / "microvllm-bench-hostile-events-tier.log")
    ok = True
    largest = 0.0
    try:
        server.wait_healthy()
        # Warm-up: the pool cycled (its pages touched), the tier written, the replay buffer fed.
        num_words = words_per_prompt(server.url)
        in_batches(server.url, long_prompts(10, "warm-up", num_words), 2)
        reference = greedy_text(server.url)
        rss_warm = server.rss_mb()
        stream = Stream(server.url)
        time.sleep(3)
        base = stream.gaps_between(time.monotonic() - 3, time.monotonic()) or [0.0]
        print(f"{'attack':38} {'answers':34} {'largest gap':>12} {'median gap':>11}")
        alone = f"{max(base) * 1e3:10.0f} ms {statistics.median(base) * 1e3:8.0f} ms"
        print(f"{'(none: the stream alone)':38} {'':34} {alone}")
        replay = f"tcp://127.0.0.1:{replay_port}"
        count = 6 if quick else 24
        attacks = [
            ("where the events/replay sockets listen", lambda: exposure([events_port, replay_port])),
            (f"{count} long prompts: tier past capacity", lambda: in_batches(
                server.url, long_prompts(count, "fill", num_words), 2)),
            ("20 replays of everything (seq 0)", lambda: replay_everything(replay, 20)),
            ("1,000 malformed replay requests", lambda: malformed_replays(replay, 1000)),
            (f"{count} more: the tier evicts again", lambda: in_batches(
                server.url, long_prompts(count, "again", num_words), 2)),
        ]
        for name, attack in attacks:
            start = time.monotonic()
            results = attack()
            end = time.monotonic()
            gaps = stream.gaps_between(start, end) or [0.0]
            largest = max(largest, max(gaps))
            answers = ", ".join(sorted(set(results)))[:34]
            print(f"{name:38} {answers:34} {max(gaps) * 1e3:10.0f} ms {statistics.median(gaps) * 1e3:8.0f} ms")
            if name.startswith("events/replay") and any("OPEN" in r for r in results):
                ok = False
            if name.startswith("20 replays") and any(
                    r.split()[0].isdigit() and int(r.split()[0]) > REPLAY_MAX_BATCHES for r in results):
                ok = False
        stream.stop()
        time.sleep(2)
        alive = server.process.poll() is None
        health = httpx.get(server.url + "/health", timeout=10).status_code if alive else None
        same = alive and greedy_text(server.url) == reference
        rss_after = server.rss_mb()
        growth = rss_after / rss_warm - 1 if rss_warm else float("nan")
        print(f"\nafter the set: server alive: {alive} (/health {health}); greedy text as before the set: {same}")
        print(f"RSS, server process: {rss_warm:.0f} MB after warm-up, {rss_after:.0f} MB after the set "
              f"({growth * 100:+.1f}%); the stream's largest gap under attack: {largest * 1e3:.0f} ms")
        ok = ok and alive and health == 200 and same and growth <= 0.10 and largest < 1.0
    finally:
        server.stop()
    if small_fs:
        refused, how = oversized_tier_refused(model, folder, logs)
        print(f"a second server, its tier larger than the {TMPFS_MB} MB tmpfs: refused at start: {refused} ({how})")
        ok = ok and refused
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
    shutil.rmtree(folder, ignore_errors=True)
    print(f"\n{'PASS' if ok else 'FAIL'}: no death, same greedy text, memory within 10 %, largest gap under 1 s")
    return ok

