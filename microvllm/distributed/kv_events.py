"""KV cache events on the wire, as vLLM sends them (``vllm/distributed/kv_events.py``).

A router that keeps a copy of each replica's prefix cache (vLLM Router's ``kv_aware``
policy, llm-d's KV cache indexer) subscribes to this stream. The block pool records
plain events (``core/block_pool.py``); after every step the engine hands them here as
one batch; a thread encodes it with msgspec and sends it on a ZMQ PUB socket::

    BlockPool.take_events() --> Engine --publish(KVEventBatch)--> queue --> thread
                                                                   |
        PUB  endpoint           [topic, seq (8 bytes, big-endian), msgpack(KVEventBatch)]
        ROUTER replay_endpoint  request [start seq]  ->  [seq, payload] per buffered
                                batch from start seq on (at most REPLAY_MAX_BATCHES),
                                then [-1 (8 bytes, signed), b""]

Both sockets are for the machine's router, not the world: a ``BlockStored`` event carries
the prompt's token ids, so whoever reads the stream reads every user's prompt. The
default endpoint is loopback (``tcp://127.0.0.1:5557``; vLLM's is ``tcp://*:5557``), a
wildcard bind logs a warning, the replay buffer keeps 1,000 batches (vLLM: 10,000) and
one replay request gets at most ``REPLAY_MAX_BATCHES`` of them: the oldest from its start
seq on, so a client that needs more asks again from the last seq it got + 1 (vLLM's
clients read until the end marker, so they work unchanged).

    KVEventBatch  array_like:  [ts, [event, ...], data_parallel_rank]
    event         a map tagged by class name, no defaults sent:
                  {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ...,
                   "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU",
                   "lora_name": None, "group_idx": 0}
                  {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": 0}
                  {"type": "AllBlocksCleared"}

A block hash goes out as vLLM's default ``ExternalBlockHash``: the low 64 bits of the
digest as an int (vLLM's ``maybe_convert_block_hash`` with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``). Our digests are sha256 over our own byte
layout (``core/kv_cache_utils.hash_block_tokens``), not vLLM's, so a consumer must use
them as opaque keys chained by ``parent_block_hash`` (or rebuild from ``token_ids``);
one that recomputes vLLM's hashes from tokens will not find ours.

msgspec and pyzmq (the ``serve`` extra) are needed only here: the engine imports this
module only when ``kv_events_config`` enables events.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from itertools import count
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from microvllm.core import block_pool as core_events
from microvllm.core.kv_cache_utils import maybe_convert_block_hash

if TYPE_CHECKING:
    from microvllm.config.kv_events import KVEventsConfig

logger = logging.getLogger(__name__)

# A block hash as routers get it: vLLM's int (low 64 bits) or, with ints off, the digest.
ExternalBlockHash = bytes | int
MEDIUM_GPU = core_events.MEDIUM_GPU

# The most batches one replay request is answered with (vLLM: no limit). A subscriber
# that missed more asks again from the last seq it got + 1.
REPLAY_MAX_BATCHES = 200
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]"})


# ------------------------------------------------------------------ the structs
# vLLM's declarations: the same names, fields, field order and struct options, so
# vLLM's own decoder (msgspec.msgpack.Decoder(KVEventBatch)) reads our bytes.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(event: core_events.KVCacheEvent) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """The block pool's plain event as vLLM's msgspec struct."""
    if isinstance(event, core_events.BlockStored):
        parent = event.parent_block_hash
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in event.block_hashes],
            parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
            token_ids=list(event.token_ids), block_size=event.block_size, lora_id=event.lora_id,
            medium=event.medium, lora_name=event.lora_name, group_idx=event.group_idx)
    if isinstance(event, core_events.BlockRemoved):
        return BlockRemoved(block_hashes=[maybe_convert_block_hash(h) for h in event.block_hashes],
                            medium=event.medium, group_idx=event.group_idx)
    if isinstance(event, core_events.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"{event!r} is not a KV cache event of core/block_pool.py")


# -------------------------------------------------------------- the publishers
class EventPublisher(ABC):
    """Sends ``EventBatch``es in order; each stamped with this replica's
    ``data_parallel_rank`` where the engine left it None (vLLM's rule)."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self._data_parallel_rank = data_parallel_rank

    @abstractmethod
    def publish(self, events: EventBatch) -> None:
        """Queue one batch; batches go out in the order published."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop sending and release every socket and thread (idempotent)."""


class NullEventPublisher(EventPublisher):
    """Sends nothing (``publisher="null"``, or events off)."""

    def publish(self, events: EventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher(EventPublisher):
    """A ZMQ PUB socket fed by a background thread, with a replay buffer of the last
    ``buffer_steps`` batches served on a ROUTER socket (see the module docstring).

    ``publish`` only queues (the engine's step never waits on the network); the thread
    numbers each batch from 0, encodes it once, sends it and keeps (seq, payload) for
    replay. A subscriber that sees a gap in the numbers asks the replay socket for
    everything from its last seq + 1 on.
    """

    SHUTDOWN_TIMEOUT: float = 1.0
    REPLAY_REQUESTS_PER_TURN = 16
    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, data_parallel_rank: int = 0, endpoint: str = "tcp://127.0.0.1:5557",
                 replay_endpoint: str | None = None, buffer_steps: int = 1_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, topic: str = "",
                 replay_max_batches: int = REPLAY_MAX_BATCHES) -> None:
        super().__init__(data_parallel_rank)
        self._replay_max_batches = replay_max_batches
        self._event_queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self._replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        self._topic_bytes = topic.encode("utf-8")
        self._seq_gen = count()
        # Our own context (vLLM shares zmq.Context.instance()): shutdown can then
        # terminate it, so nothing of ours outlives the engine.
        self._ctx = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            # vLLM's rule (bind a wildcard or local address, connect to anything else),
            # plus: a loopback address binds (our default).
            if binds(self._endpoint):
                warn_if_wildcard(self._endpoint, "endpoint")
                self._pub.bind(self._endpoint)
            else:
                self._pub.connect(self._endpoint)
            if self._replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                warn_if_wildcard(self._replay_endpoint, "replay_endpoint")
                self._replay.bind(self._replay_endpoint)
        except zmq.ZMQError as error:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {self._endpoint!r} / {self._replay_endpoint!r} "
                             f"({error}): pick a free port or another endpoint") from None
        self._running = True
        self._thread = threading.Thread(target=self._publisher_thread, daemon=True, name="zmq-publisher")
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The PUB endpoint after the data-parallel rank's port offset."""
        return self._endpoint

    def publish(self, events: EventBatch) -> None:
        if not self._running:
            raise RuntimeError("the KV event publisher was shut down: create a new engine")
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._data_parallel_rank
        self._event_queue.put(events)

    def shutdown(self) -> None:
        """Send what is queued (for up to ``SHUTDOWN_TIMEOUT`` s), stop the thread, close
        both sockets and the context. Idempotent."""
        if not self._running:
            return
        self._running = False
        self._event_queue.put(None)   # after every queued batch: they go out first
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():
            logger.warning("the KV event publisher thread did not stop within %.1f s", self.SHUTDOWN_TIMEOUT)
            return   # its sockets are still in use: the daemon thread ends with the process
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._ctx.term()

    # ----------------------------------------------------------- the thread
    def _publisher_thread(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        assert self._pub is not None
        while True:
            # Up to REPLAY_REQUESTS_PER_TURN waiting requests, then the next batch: a flood
            # of requests (each answered with at most replay_max_batches) delays the stream
            # by a bounded amount, and a malformed one costs next to nothing.
            for _ in range(self.REPLAY_REQUESTS_PER_TURN):
                if self._replay is None or not self._replay.poll(0):
                    break
                try:
                    self._service_replay()
                except Exception:   # a bad request must not stop the stream
                    logger.exception("KV event replay request failed")
            try:
                batch = self._event_queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                seq = next(self._seq_gen)
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:
                logger.exception("publishing a KV event batch failed")
                time.sleep(0.1)

    def _service_replay(self) -> None:
        """[identity, b"", start seq] -> the buffered [seq, payload] from start seq on, at
        most ``replay_max_batches`` of them (the oldest first), then the end marker
        [-1, b""] (each reply prefixed by identity and b""). A request of another shape
        is dropped with a debug line (it comes from the network: no warning per request)."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) > 8:
            logger.debug("invalid KV event replay request of %d frames (want 3: id, b'', 8-byte seq)", len(frames))
            return
        client_id, _, start_seq_bytes = frames
        start_seq = int.from_bytes(start_seq_bytes, "big")
        sent = 0
        for seq, payload in list(self._buffer):
            if sent >= self._replay_max_batches:
                break
            if seq >= start_seq:
                self._replay.send_multipart((client_id, b"", seq.to_bytes(8, "big"), payload))
                sent += 1
        self._replay.send_multipart((client_id, b"", self.END_SEQ, b""))


def endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint (``[::1]`` keeps its brackets); None for
    any other transport."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, _ = endpoint.removeprefix("tcp://").rpartition(":")
    return host.split(";")[-1]   # "tcp://SOURCE;HOST:PORT": the host after the source


def is_wildcard(endpoint: str) -> bool:
    """Whether a tcp endpoint binds every interface: ``*``, ``0.0.0.0``, ``::``."""
    return endpoint_host(endpoint) in WILDCARD_HOSTS


def is_loopback(endpoint: str) -> bool:
    """Whether a tcp endpoint's host is 127.x.x.x or ``::1``."""
    host = endpoint_host(endpoint)
    if host is None:
        return False
    import ipaddress
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def binds(endpoint: str) -> bool:
    """vLLM's rule: a PUB endpoint with "*" or "::", or ipc:// / inproc://, is bound, any
    other connected (to a subscriber that binds); ours also binds a loopback one."""
    return any(mark in endpoint for mark in ("*", "::")) or endpoint.startswith(("ipc://", "inproc://")) \
        or is_wildcard(endpoint) or is_loopback(endpoint)


def warn_if_wildcard(endpoint: str, name: str) -> None:
    """A wildcard bind puts every user's prompt on every interface: say so, and what to set."""
    if is_wildcard(endpoint):
        logger.warning(
            "kv_events_config %s=%r binds every network interface: anyone who can reach this port reads "
            "the token ids of every user's prompt (BlockStored events)%s. Set it to tcp://127.0.0.1:PORT "
            "(the default) unless a router on another host subscribes, and then let only that host in "
            "(a firewall)", name, endpoint,
            ", and can ask for the past batches" if name == "replay_endpoint" else "")


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """Data-parallel rank r publishes on port + r (tcp) or ``<name>_dp<r>`` (inproc),
    as vLLM's; rank 0 and ipc:// endpoints are unchanged."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    return endpoint


class EventPublisherFactory:
    """``kv_events_config.publisher`` -> a publisher (vLLM's registry)."""

    _registry: dict[str, Any] = {"null": NullEventPublisher, "zmq": ZmqEventPublisher}

    @classmethod
    def register_publisher(cls, name: str, ctor) -> None:
        if name in cls._registry:
            raise KeyError(f"publisher {name!r} is already registered")
        cls._registry[name] = ctor

    @classmethod
    def create(cls, config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
        if config is None or not config.enable_kv_cache_events or config.publisher == "null":
            return NullEventPublisher()
        try:
            constructor = cls._registry[config.publisher or "zmq"]
        except KeyError:
            raise ValueError(f"kv_events_config publisher={config.publisher!r} is not a publisher: choose one "
                             f"of {sorted(cls._registry)}") from None
        return constructor(data_parallel_rank=data_parallel_rank, endpoint=config.endpoint,
                           replay_endpoint=config.replay_endpoint, buffer_steps=config.buffer_steps,
                           hwm=config.hwm, max_queue_size=config.max_queue_size, topic=config.topic)
