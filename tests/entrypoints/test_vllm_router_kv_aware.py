"""The real vLLM router's ``kv_aware`` policy, fed by our KV cache events.

    microvllm serve (replica 0) --PUB tcp://127.0.0.1:P0--+
    microvllm serve (replica 1) --PUB tcp://127.0.0.1:P1--+--SUB--> vllm-router --policy kv_aware
                                                            --kv-event-source URL0=tcp://127.0.0.1:P0 ...

What the router does with the events (vllm-project/router's ``src/kv_index/wire.rs`` at
0e7a5e1e, ``local_hash.rs`` at 9ba67a70, ``indexer.rs`` at 57baaf95; the 0.1.17 wheel's
log lines, ``kv_index/subscriber.rs`` and ``policies/kv_aware.rs:1314``, show the same
design at work, and this test shows it matching our blocks):

* it decodes vLLM's msgspec batches; a ``BlockStored``'s ``block_hashes`` and
  ``parent_block_hash`` (bytes or an unsigned int: our low-64-bit ints are accepted)
  are *opaque keys*, used only to find a store's parent and what a ``BlockRemoved``
  drops (wire.rs: "Opaque key for parent chaining and remove lookup only");
* what it matches on is its own "local hash" of each block, computed from the event's
  ``token_ids``: sha256 of the block's token ids as little-endian u32, seeded only by
  ``lora_name``, no parent chaining (local_hash.rs ``local_hashes``); the position of
  a block is its path in a radix tree (indexer.rs ``GroupShard::store``/``find_matches``);
* for a request it tokenizes the prompt with the Hugging Face tokenizer of
  ``--kv-event-model`` (here the model folder: its tokenizer.json), cuts the ids into
  ``--kv-event-block-size`` blocks, hashes them the same way and walks the tree: the
  replica with the deepest contiguous match gets its prefix credited
  (log: ``KV prefix decision ... credited_prefix_tokens=N``, kv_aware.rs).

(An older ``kv_aware.rs``, 71af9941, recomputed vLLM's chained block keys from the
tokens with a ``hash_seed`` "must match vLLM PYTHONHASHSEED": that would never have matched
our sha256 hashes. The router we test no longer does that.)

So neither vLLM's hash function, NONE_HASH, PYTHONHASHSEED nor our sha256 layout
matters: the router needs only the token ids in ``BlockStored`` (we send them), the
same tokenizer, the same block size, and an endpoint it can *connect* to. The one
setting that matters: the router connects its SUB socket, so the replica's
``endpoint`` must be one that binds: ``tcp://127.0.0.1:P`` (ours: a loopback address
binds) or ``tcp://*:P`` (vLLM's rule; every interface). Under vLLM's rule alone
``tcp://127.0.0.1:P`` would make the PUB connect too and no event would ever arrive (every
decision then shows ``credited_prefix_tokens=0`` and the policy falls back to the least
prefill cost).
"""

import json
import re
import time

import httpx
import pytest

from microvllm.models.tiny import make_tiny_model
from tests.entrypoints.test_vllm_router import ROUTER, Router, counter
from tests.support import SETTINGS, Server, free_port, wait_for

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not __import__("pathlib").Path(ROUTER).is_file(),
                       reason="the vllm-router wheel is not installed (pip install vllm-router: the dev extra)"),
]

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_aware")
    folder = make_tiny_model(root / "model", "llama", seed=3)
    ports = [free_port() for _ in range(2)]
    servers = [Server(folder, root / f"replica{i}.log", flags=[*SETTINGS, "--kv-events-config", json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"})])
        for i, port in enumerate(ports)]
    router = None
    try:
        for server in servers:
            wait_for(server.healthy, 180, "a replica to start")
        sources = [arg for server, port in zip(servers, ports)
                   for arg in ("--kv-event-source", f"{server.url}=tcp://127.0.0.1:{port}")]
        router = Router(servers, "kv_aware", root / "router.log", *sources, "--kv-event-block-size", "16",
                        "--kv-event-model", str(folder), "--log-level", "debug",
                        "--prometheus-port", str(free_port()))
        yield folder, servers, router, root / "router.log"
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()


def router_log(path) -> str:
    return ANSI.sub("", path.read_text())


def served(servers) -> list[float]:
    return [counter(s.url, "request_success_total") for s in servers]


def test_kv_aware_sends_a_prefix_to_the_replica_whose_events_hold_it(cluster):
    """Seed prefix A on replica 0 and prefix B on replica 1 directly (not through the
    router); the router learns it only from their KV events. Then every repeat of A goes
    to replica 0 and every repeat of B to replica 1, each a prefix-cache hit there."""
    folder, servers, router, log = cluster
    prefixes = [f"tenant {k} system prompt: " + " ".join(f"policy {k}{j}." for j in range(40)) for k in range(2)]
    for server, prefix in zip(servers, prefixes):
        response = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": str(folder), "prompt": prefix + " Warm up?", "max_tokens": 2, "temperature": 0})
        assert response.status_code == 200, response.text

    def events_arrived() -> bool:
        text = router_log(log)
        return all(re.search(rf"kv_index live sequence advanced source={re.escape(s.url)}", text) for s in servers)

    wait_for(events_arrived, 30, "the router to receive both replicas' KV events", interval=0.2)
    time.sleep(0.5)   # the last batch of the warm-up requests

    hits_before = [counter(s.url, "prefix_cache_hits_total") for s in servers]
    for i in range(6):
        owner = i % 2
        before = served(servers)
        response = router.complete(prefixes[owner] + f" Question {i}?", str(folder))
        assert response.status_code == 200, response.text
        delta = [a - b for a, b in zip(served(servers), before)]
        assert delta[owner] == 1 and sum(delta) == 1, (i, owner, delta)
    hits = [counter(s.url, "prefix_cache_hits_total") - h for s, h in zip(servers, hits_before)]
    assert all(h >= 3 * 16 for h in hits), hits   # each repeat reused at least the prefix's first blocks

    credited = [int(m) for m in re.findall(r"KV prefix decision .*?credited_prefix_tokens=(\d+)", router_log(log))]
    assert len(credited) >= 6 and all(c >= 16 for c in credited[-6:]), credited
