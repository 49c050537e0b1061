"""KV cache events on the wire: a real engine publishes vLLM's KVEventBatch over ZMQ, and
a subscriber that decodes it with vLLM's own struct declarations rebuilds the block
pool's prefix cache exactly, step by step, through evictions and a reset."""

from __future__ import annotations

import gc
import logging
import shutil
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from microvllm import LLM, SamplingParams  # noqa: E402
from microvllm.bench.hostile_events_tier import listening_addresses  # noqa: E402
from microvllm.config import KVEventsConfig  # noqa: E402
from microvllm.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from microvllm.engine.arg_utils import EngineArgs  # noqa: E402
from microvllm.models.tiny import make_tiny_model  # noqa: E402

TIMEOUT_MS = 5000


# vLLM's declarations (vllm/distributed/kv_events.py), written out here on their own: our
# bytes must decode with vLLM's classes, not only with ours.
class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(VllmKVEventBatch)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kv_events") / "llama", "llama", seed=7)


@pytest.fixture
def sock_dir():
    path = tempfile.mkdtemp(prefix="kvev", dir="/tmp")   # short: ipc paths are limited to ~100 chars
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def publisher_threads():
    return [t for t in threading.enumerate() if t.name == "zmq-publisher" and t.is_alive()]


def make_llm(model, sock_dir, **events):
    config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{sock_dir}/pub", "topic": "kv", **events}
    return LLM(str(model), block_size=4, num_kv_blocks=10, max_model_len=64, max_num_batched_tokens=32,
               max_num_seqs=4, kv_events_config=config, debug_invariants=True)


def subscribe(context, endpoint):
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    return sub


def wait_until_subscribed(llm, sub):
    """PUB drops what it sends before a subscription arrives (ZMQ's slow joiner): publish
    empty batches until one gets through, then let the test number from the next one."""
    from microvllm.distributed.kv_events import KVEventBatch

    sub.setsockopt(zmq.RCVTIMEO, 100)
    for _ in range(50):
        llm.engine.kv_event_publisher.publish(KVEventBatch(ts=0.0, events=[]))
        try:
            _, seq, _ = sub.recv_multipart()
            break
        except zmq.Again:
            continue
    else:
        raise AssertionError("the subscriber never received a batch")
    while True:   # drain any that were in flight
        try:
            _, seq, _ = sub.recv_multipart()
        except zmq.Again:
            break
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    return int.from_bytes(seq, "big") + 1


class Mirror:
    """What a router keeps: (group, hash) -> how many blocks hold it."""

    def __init__(self):
        self.counts: Counter = Counter()

    def apply(self, batch):
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.counts.update((event.group_idx, h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.counts.subtract((event.group_idx, h) for h in event.block_hashes)
            else:
                self.counts.clear()
        self.counts = +self.counts


def pool_contents(llm):
    pool = llm.engine.kv_cache_manager.block_pool
    return Counter({(group, maybe_convert_block_hash(h)): len(blocks)
                    for (h, group), blocks in pool.cached_block_hash_to_block.items()})


def prompts(round_index):
    shared = list(range(3, 15))                       # 3 full blocks every prompt shares
    return [{"prompt_token_ids": shared + [20 + round_index * 7 + i] * (5 + 3 * i)} for i in range(3)]


def test_a_subscriber_rebuilds_the_prefix_cache_exactly(model, sock_dir, context):
    llm = make_llm(model, sock_dir)
    engine = llm.engine
    published = []
    publish = engine.kv_event_publisher.publish
    engine.kv_event_publisher.publish = lambda batch: (published.append(batch), publish(batch))[1]
    sub = subscribe(context, f"ipc://{sock_dir}/pub")
    next_seq = wait_until_subscribed(llm, sub)
    published.clear()
    mirror, kinds, params = Mirror(), Counter(), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def receive_step_batches():
        nonlocal next_seq
        for _ in range(len(published)):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and int.from_bytes(seq, "big") == next_seq   # consecutive
            next_seq += 1
            raw = msgspec.msgpack.decode(payload)       # the layout itself, untyped
            assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0   # [ts, events, rank 0]
            assert all(isinstance(e, dict) and e["type"] in kinds.keys() | {"BlockStored", "BlockRemoved",
                                                                            "AllBlocksCleared"} for e in raw[1])
            batch = DECODER.decode(payload)
            kinds.update(type(e).__name__ for e in batch.events)
            mirror.apply(batch)
        published.clear()
        assert mirror.counts == pool_contents(llm)

    for round_index in range(4):
        for i, prompt in enumerate(prompts(round_index)):
            engine.add_request(f"r{round_index}-{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
            receive_step_batches()
    assert kinds["BlockStored"] and kinds["BlockRemoved"], kinds   # the small pool evicted
    assert engine.reset_prefix_cache()
    receive_step_batches()                        # published at once, not at the next step
    assert kinds["AllBlocksCleared"] == 1 and not mirror.counts and not pool_contents(llm)
    for i, prompt in enumerate(prompts(9)):
        engine.add_request(f"after-{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        receive_step_batches()
    assert mirror.counts and mirror.counts == pool_contents(llm)
    llm.shutdown()
    assert not publisher_threads()


def test_block_stored_carries_the_chain_and_tokens(model, sock_dir, context):
    llm = make_llm(model, sock_dir)
    sub = subscribe(context, f"ipc://{sock_dir}/pub")
    wait_until_subscribed(llm, sub)
    tokens = list(range(3, 14))                   # 11 tokens: 2 full blocks of 4
    llm.generate([{"prompt_token_ids": tokens}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    _, _, payload = sub.recv_multipart()
    (event,) = DECODER.decode(payload).events
    request_hashes = [maybe_convert_block_hash(h) for h, _ in
                      llm.engine.kv_cache_manager.block_pool.cached_block_hash_to_block]
    assert event.block_hashes == request_hashes and event.parent_block_hash is None
    assert event.token_ids == tokens[:8] and event.block_size == 4
    assert (event.lora_id, event.medium, event.lora_name, event.group_idx) == (None, "GPU", None, 0)
    llm.shutdown()


def test_replay_returns_missed_batches(model, sock_dir, context):
    llm = make_llm(model, sock_dir, replay_endpoint=f"ipc://{sock_dir}/replay", buffer_steps=3)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(5):                           # nobody listens: every batch is missed
        llm.generate([{"prompt_token_ids": [3 + i] * 9}], params, use_tqdm=False)
    replay = context.socket(zmq.DEALER)          # DEALER: many replies to one request
    replay.setsockopt(zmq.LINGER, 0)
    replay.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    replay.connect(f"ipc://{sock_dir}/replay")

    def ask(start_seq):
        replay.send_multipart([b"", start_seq.to_bytes(8, "big")])
        got = []
        while True:
            empty, seq, payload = replay.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return got
            got.append((seq, DECODER.decode(payload)))

    everything = ask(0)                          # one batch per generate; the last buffer_steps are kept
    assert [seq for seq, _ in everything] == [2, 3, 4]
    assert all(any(isinstance(e, BlockStored) for e in b.events) for _, b in everything)
    assert [seq for seq, _ in ask(4)] == [4] and ask(5) == []
    llm.shutdown()


def test_events_off_publish_nothing_and_start_no_thread(model):
    before = publisher_threads()
    llm = LLM(str(model), block_size=4, num_kv_blocks=6, max_model_len=64)
    llm.generate([{"prompt_token_ids": list(range(3, 20))}], SamplingParams(max_tokens=2), use_tqdm=False)
    pool = llm.engine.kv_cache_manager.block_pool
    assert llm.engine.kv_event_publisher is None and not pool.enable_kv_cache_events
    assert pool.kv_event_queue == [] and publisher_threads() == before


def test_null_publisher_records_but_sends_nothing(model):
    from microvllm.distributed.kv_events import NullEventPublisher

    llm = LLM(str(model), block_size=4, num_kv_blocks=6, max_model_len=64,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "null"})
    assert isinstance(llm.engine.kv_event_publisher, NullEventPublisher) and not publisher_threads()
    llm.generate([{"prompt_token_ids": list(range(3, 20))}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.kv_cache_manager.block_pool.kv_event_queue == []   # drained each step


def test_the_publisher_stops_when_the_engine_is_collected(model, sock_dir):
    llm = make_llm(model, sock_dir)
    assert len(publisher_threads()) == 1
    del llm
    gc.collect()
    assert not publisher_threads()


def test_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['endpiont'\]"):
        KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpiont": "tcp://*:1"})
    with pytest.raises(ValueError, match="publisher='kafka' is not a publisher"):
        KVEventsConfig.from_dict({"enable_kv_cache_events": True, "publisher": "kafka"})
    with pytest.raises(ValueError, match="buffer_steps=0"):
        KVEventsConfig.from_dict({"buffer_steps": 0})
    assert KVEventsConfig.from_dict('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert KVEventsConfig.from_dict({}).publisher == "null"


def test_the_cli_flag_parses_json():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "topic": "a"}'])
    assert EngineArgs.from_cli_args(args).kv_events_config == {"enable_kv_cache_events": True, "topic": "a"}


def test_data_parallel_rank_offsets_the_port_and_tags_its_batches(model, context):
    """Replica r of a data-parallel deployment publishes on port + r (vLLM's rule), so N
    engines on one machine do not fight over one port, and says which rank it is."""
    from tests.support import free_port

    port = free_port()
    while True:   # port + 1 must be free too
        try:
            probe = context.socket(zmq.PUB)
            probe.bind(f"tcp://127.0.0.1:{port + 1}")
            probe.close(linger=0)
            break
        except zmq.ZMQError:
            port = free_port()
    llm = LLM(str(model), block_size=4, num_kv_blocks=10, max_model_len=64, data_parallel_size=2,
              data_parallel_rank=1, kv_events_config={"enable_kv_cache_events": True, "topic": "kv",
                                                      "endpoint": f"tcp://*:{port}"})   # "*": bind
    assert llm.engine.config.parallel_config.data_parallel_rank == 1
    assert llm.engine.kv_event_publisher.endpoint == f"tcp://*:{port + 1}"
    sub = subscribe(context, f"tcp://127.0.0.1:{port + 1}")
    wait_until_subscribed(llm, sub)
    llm.generate([{"prompt_token_ids": list(range(3, 14))}], SamplingParams(temperature=0.0, max_tokens=1),
                 use_tqdm=False)
    _, _, payload = sub.recv_multipart()
    batch = DECODER.decode(payload)
    assert batch.data_parallel_rank == 1 and isinstance(batch.events[0], BlockStored)
    llm.shutdown()
    with pytest.raises(ValueError, match="data_parallel_rank"):
        LLM(str(model), data_parallel_size=2, data_parallel_rank=2)


# ------------------------------------------------------------ exposure (a hostile client)
def test_the_default_endpoint_binds_loopback_only_and_a_wildcard_logs_a_warning(context, caplog):
    from microvllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
    from tests.support import free_port

    port, replay_port = free_port(), free_port()
    with caplog.at_level(logging.WARNING):
        publisher = ZmqEventPublisher(endpoint=f"tcp://127.0.0.1:{port}",
                                      replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv")
    try:
        assert not [r for r in caplog.records if "network interface" in r.getMessage()]
        assert listening_addresses(port) == {"127.0.0.1"} and listening_addresses(replay_port) == {"127.0.0.1"}
        sub = subscribe(context, f"tcp://127.0.0.1:{port}")   # bound (vLLM's rule would connect)
        sub.setsockopt(zmq.RCVTIMEO, 100)
        for _ in range(50):
            publisher.publish(KVEventBatch(ts=0.0, events=[]))
            try:
                assert sub.recv_multipart()[0] == b"kv"
                break
            except zmq.Again:
                continue
        else:
            raise AssertionError("nothing arrived on the loopback endpoint")
    finally:
        publisher.shutdown()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        publisher = ZmqEventPublisher(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://0.0.0.0:{replay_port}")
    publisher.shutdown()
    warnings = [r.getMessage() for r in caplog.records if "network interface" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert all("token ids of every user's prompt" in w and "tcp://127.0.0.1:PORT" in w for w in warnings)
    assert "past batches" in warnings[1]


def test_one_replay_request_gets_at_most_the_cap_and_the_rest_by_asking_again(context):
    """An attacker asking for everything gets REPLAY_MAX_BATCHES batches; a client that
    asks again from the last seq + 1 gets the rest, in order (vLLM's end marker each time)."""
    from microvllm.distributed.kv_events import REPLAY_MAX_BATCHES, KVEventBatch, ZmqEventPublisher
    from tests.support import free_port

    replay_port = free_port()
    publisher = ZmqEventPublisher(endpoint=f"tcp://127.0.0.1:{free_port()}",
                                  replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    total = 2 * REPLAY_MAX_BATCHES + 50
    for _ in range(total):
        publisher.publish(KVEventBatch(ts=0.0, events=[]))
    deadline = time.monotonic() + 10
    while len(publisher._buffer) < total and time.monotonic() < deadline:
        time.sleep(0.01)
    replay = context.socket(zmq.DEALER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    replay.connect(f"tcp://127.0.0.1:{replay_port}")

    def ask(start_seq):
        replay.send_multipart([b"", start_seq.to_bytes(8, "big")])
        got = []
        while True:
            _, seq, payload = replay.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                return got
            got.append(seq)

    try:
        first = ask(0)
        assert first == list(range(REPLAY_MAX_BATCHES))
        assert REPLAY_MAX_BATCHES == 200 and KVEventsConfig().buffer_steps == 1_000   # vLLM: no cap, 10,000
        second = ask(first[-1] + 1)
        assert second == list(range(REPLAY_MAX_BATCHES, 2 * REPLAY_MAX_BATCHES))
        assert ask(second[-1] + 1) == list(range(2 * REPLAY_MAX_BATCHES, total))
        replay.send_multipart([b"", b"x" * 100])   # a malformed request: dropped, the stream goes on
        assert ask(total - 1) == [total - 1]
    finally:
        publisher.shutdown()
