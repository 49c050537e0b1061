"""``P2PConnector``: prefill/decode disaggregation between two engines (vLLM: the NIXL
connector, ``kv_connector/v1/nixl_connector.py``, and its request protocol, which
``vllm-router --vllm-pd-disaggregation --kv-connector nixl`` speaks)::

    client ──> router ── 1. {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}
                 │          ──> prefill instance (kv_role kv_producer)
                 │              prefills; request_finished keeps its blocks (delayed free) and
                 │      <── answers "kv_transfer_params": {"do_remote_prefill": true,
                 │              "remote_engine_id", "remote_block_ids", "remote_host",
                 │              "remote_port", "remote_request_id", ...}
                 └──── 2. the client's request + those kv_transfer_params
                          ──> decode instance (kv_role kv_consumer)
                              get_num_new_matched_tokens: the prompt's full blocks past its
                              local hit; WAITING_FOR_REMOTE_KVS while a thread reads them
                              from the producer's side channel; then decodes
                              ── "read" (request, block ids) ──> producer side channel
                              <── the blocks' bytes, every layer; ack ──
                              producer: finished_sending -> its blocks are freed

Transport: one plain TCP connection per transfer to a side-channel listener thread in
the producer's worker, pulled by the consumer (as NIXL's decode side reads the remote
blocks). Why: on loopback a socket moves the blocks at memory speed with no extra
dependency; it needs no rendezvous fixed at start (torch.distributed send/recv would bind
both processes into one process group for life, so a restarted producer would break the
consumer); each transfer fails on its own (a refused connection, a timeout, a short read)
and the request falls back to computing its prompt; and the same code runs between two
hosts. Shared memory would save one copy, but its lifetime would have to be managed
across two processes that may die independently.

Who frees what, when:

- producer: a finished ``do_remote_decode`` request that stopped on length (max_tokens=1)
  keeps its blocks (``request_finished`` -> delay_free) until the consumer has read them
  and acknowledged, or ``send_timeout_s`` passed (a decode instance that died, or a
  request the router never sent on): then ``finished_sending`` frees them. A read that
  names another engine id (the producer restarted: a new ``engine_id``), an unknown or
  expired request, or blocks it was not given is refused.
- consumer: the loaded blocks are the request's own (not cached until loaded). A load
  that fails (refused, timed out after ``load_timeout_s``, a refused read) is reported in
  ``failed_recving``: the scheduler frees the blocks and the request computes its prompt
  (vLLM's ``kv_load_failure_policy="recompute"``), tokens unchanged. A request aborted
  while its blocks are read keeps them until the read ends (the bytes land in a staging
  buffer and are copied into the cache only inside a step, never by the reading thread),
  then both sides free.

Options (``kv_connector_extra_config``): ``host`` (the side channel's address, default
127.0.0.1), ``port`` (default 0: any free port), ``send_timeout_s`` (default 120),
``load_timeout_s`` (default 30). One worker process only (tensor_parallel_size 1): the
side channel reads the worker's KV cache in the engine process.
"""

from __future__ import annotations

import hashlib
import json
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from microvllm.distributed.kv_transfer.kv_connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from microvllm.config import EngineConfig
    from microvllm.core.kv_cache_manager import KVCacheBlocks
    from microvllm.core.kv_cache_spec import KVCacheSpec
    from microvllm.core.request import Request
    from microvllm.core.sched_output import SchedulerOutput

# The side channel's port of each producer engine in this process (engine id -> port),
# written by the worker side when it binds, read by the scheduler side for its answers.
_SIDE_CHANNEL_PORTS: dict[str, int] = {}
_SIDE_CHANNEL_READY = threading.Condition()


def prompt_digest(token_ids: list[int], num_blocks: int, block_size: int) -> str:
    """A short digest of the tokens the blocks hold: the consumer checks its prompt is the one
    the producer prefilled before reading them."""
    data = struct.pack(f"<{num_blocks * block_size}q", *token_ids[:num_blocks * block_size])
    return hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclass
class RemoteLoad:
    block_ids: tuple[int, ...]          # here, to fill
    remote_block_ids: tuple[int, ...]   # there, to read
    params: dict


@dataclass
class P2PConnectorMetadata(KVConnectorMetadata):
    """One step's orders: loads to start (consumer), loads still wanted (a load whose
    request left is dropped), releases to send (a remote prefill not read after all), and
    sends to serve (producer: request -> (block ids, deadline))."""

    reqs_to_load: dict[str, RemoteLoad] = field(default_factory=dict)
    loads_wanted: set[str] = field(default_factory=set)
    reqs_to_release: dict[str, dict] = field(default_factory=dict)
    reqs_to_send: dict[str, tuple[tuple[int, ...], float]] = field(default_factory=dict)
    idle: bool = False   # nothing computed this step: wait a little for a transfer


def _send_msg(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def _recv_exact(sock: socket.socket, size: int, into: memoryview | None = None) -> bytes:
    buffer = into if into is not None else memoryview(bytearray(size))
    got = 0
    while got < size:
        n = sock.recv_into(buffer[got:], size - got)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n
    return bytes(buffer) if into is None else b""


def _recv_msg(sock: socket.socket) -> dict:
    (size,) = struct.unpack("<I", _recv_exact(sock, 4))
    return json.loads(_recv_exact(sock, size))


class P2PConnector(KVConnectorBase):
    """Disaggregated prefill (see the module docstring): kv_producer serves its finished
    prompts' blocks, kv_consumer reads them."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, num_kv_blocks: int,
                 kv_cache_specs: list[KVCacheSpec]) -> None:
        super().__init__(config, role, num_kv_blocks, kv_cache_specs)
        if len(kv_cache_specs) != 1 or type(kv_cache_specs[0]).__name__ != "FullAttentionSpec":
            raise ValueError("P2PConnector needs a model whose layers all use full attention (one cache group), "
                             f"but its cache groups are {kv_cache_specs}: drop kv_transfer_config")
        if config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("P2PConnector serves the KV cache of one worker: set tensor_parallel_size=1")
        if not config.cache_config.enable_prefix_caching:
            raise ValueError("P2PConnector hands loaded blocks to the scheduler as prefix-cache hits: "
                             "set enable_prefix_caching=True")
        if self.kv_transfer_config.kv_role == "kv_both":
            raise ValueError('P2PConnector: kv_role is "kv_producer" (prefill) or "kv_consumer" (decode)')
        get = self.kv_transfer_config.get_from_extra_config
        self.host = str(get("host", "127.0.0.1"))
        self.port = int(get("port", 0))
        self.send_timeout_s = float(get("send_timeout_s", 120.0))
        self.load_timeout_s = float(get("load_timeout_s", 30.0))
        self.engine_id = str(self.kv_transfer_config.engine_id)
        if role == KVConnectorRole.SCHEDULER:
            self._matched: dict[str, tuple[int, int]] = {}     # request -> (first block, count)
            self._tried: set[str] = set()                      # asked once: never loaded twice
            self._loads: dict[str, RemoteLoad] = {}            # not yet handed to the worker
            self._loads_in_flight: dict[str, Request] = {}     # handed over, not reported
            self._aborted_loads: set[str] = set()              # finished while in flight
            self._releases: dict[str, dict] = {}
            self._sends: dict[str, tuple[tuple[int, ...], float]] = {}
        else:
            self._lock = threading.Condition()
            self.kv_caches: list[torch.Tensor] = []
            self._serving: dict[str, tuple[tuple[int, ...], float]] = {}   # producer: readable
            self._done_sending: set[str] = set()
            self._staged: dict[str, tuple[RemoteLoad, list[torch.Tensor] | None]] = {}   # consumer: read
            self._server: socketserver.ThreadingTCPServer | None = None

    # ========================================================= scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """A ``do_remote_prefill`` request: the prompt's full blocks past the local hit that
        the producer holds, never the last token's block. Asked once per request."""
        params = request.kv_transfer_params
        if (not self.kv_transfer_config.is_kv_consumer or not params or not params.get("do_remote_prefill")
                or request.request_id in self._tried):
            return 0, False
        self._tried.add(request.request_id)
        remote = params.get("remote_block_ids") or []
        first = num_computed_tokens // self.block_size
        last = min(len(remote), (request.num_prompt_tokens - 1) // self.block_size)
        if last <= first or params.get("remote_prompt_digest") != prompt_digest(
                request.prompt_token_ids, len(remote), self.block_size):
            self._releases[request.request_id] = params   # nothing to read: free the producer's now
            return 0, False
        self._matched[request.request_id] = (first, last - first)
        return (last - first) * self.block_size, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        params = request.kv_transfer_params
        if matched is None or params is None:
            return
        if num_external_tokens == 0:   # no room: the request computes its prompt
            self._releases[request.request_id] = params
            return
        first, count = matched
        block_ids = blocks.get_block_ids()[0][first:first + count]
        self._loads[request.request_id] = RemoteLoad(tuple(block_ids), tuple(params["remote_block_ids"]
                                                                          [first:first + count]), params)
        self._loads_in_flight[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2PConnectorMetadata:
        from microvllm.core.request import RequestStatus
        wanted = {rid for rid, r in self._loads_in_flight.items()
                  if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS or rid in self._aborted_loads}
        for rid in set(self._loads_in_flight) - wanted:   # put back by a failed step: forgotten
            del self._loads_in_flight[rid]
            self._loads.pop(rid, None)
        metadata = P2PConnectorMetadata(reqs_to_load=self._loads, loads_wanted=wanted,
                                        reqs_to_release=self._releases, reqs_to_send=self._sends,
                                        idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._loads, self._releases, self._sends = {}, {}, {}
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A load ended (read or failed): a request aborted meanwhile frees its blocks now."""
        ended = (connector_output.finished_recving or set()) | (connector_output.failed_recving or set())
        for request_id in ended:
            self._loads_in_flight.pop(request_id, None)
            if request_id in self._aborted_loads:
                self._aborted_loads.discard(request_id)
                connector_output.finished_sending = (connector_output.finished_sending or set()) | {request_id}

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        from microvllm.core.request import RequestStatus
        request_id = request.request_id
        self._matched.pop(request_id, None)
        self._tried.discard(request_id)
        load = self._loads.pop(request_id, None)
        if load is not None:            # aborted before its read started: tell the producer
            self._loads_in_flight.pop(request_id, None)
            self._releases[request_id] = load.params
        if request_id in self._loads_in_flight:   # being read into its blocks: free them after
            self._aborted_loads.add(request_id)
            return True, None
        params = request.kv_transfer_params
        if (not self.kv_transfer_config.is_kv_producer or not params or not params.get("do_remote_decode")
                or request.status != RequestStatus.FINISHED_LENGTH_CAPPED):
            return False, None
        num_full = min(request.num_prompt_tokens // self.block_size, len(block_ids[0]))
        remote_block_ids = tuple(block_ids[0][:num_full])
        answer = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                  "remote_block_ids": list(remote_block_ids), "remote_host": self.host,
                  "remote_port": self._side_channel_port(), "remote_request_id": request_id,
                  "remote_prompt_digest": prompt_digest(request.prompt_token_ids, num_full, self.block_size),
                  "tp_size": 1}
        if not remote_block_ids:
            return False, answer
        self._sends[request_id] = (remote_block_ids, time.monotonic() + self.send_timeout_s)
        return True, answer

    def _side_channel_port(self) -> int:
        with _SIDE_CHANNEL_READY:
            _SIDE_CHANNEL_READY.wait_for(lambda: self.engine_id in _SIDE_CHANNEL_PORTS, timeout=30)
            return _SIDE_CHANNEL_PORTS[self.engine_id]

    # ============================================================ worker side
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        self.kv_caches = kv_caches
        if not self.kv_transfer_config.is_kv_producer:
            return
        connector = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                connector._serve_one(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="p2p-kv-side-channel", daemon=True).start()
        with _SIDE_CHANNEL_READY:
            _SIDE_CHANNEL_PORTS[self.engine_id] = self._server.server_address[1]
            _SIDE_CHANNEL_READY.notify_all()

    def _serve_one(self, sock: socket.socket) -> None:
        """Producer: one consumer's read (or release) of one request's blocks."""
        sock.settimeout(self.load_timeout_s)
        try:
            ask = _recv_msg(sock)
            request_id = str(ask.get("request_id"))
            with self._lock:   # the step that registers the send may not have run yet
                self._lock.wait_for(lambda: request_id in self._serving, timeout=5.0)
                entry = self._serving.get(request_id)
            why = None
            if ask.get("engine_id") != self.engine_id:
                why = f"engine id {ask.get('engine_id')!r} is not this engine's ({self.engine_id}): it restarted"
            elif entry is None:
                why = f"request {request_id!r} has no blocks here (unknown, freed or expired)"
            elif not set(ask.get("block_ids", ())) <= set(entry[0]):
                why = "asked for blocks the request does not hold"
            if why is not None:
                _send_msg(sock, {"ok": False, "error": why})
                return
            if ask.get("op") == "release":
                self._mark_sent(request_id)
                _send_msg(sock, {"ok": True})
                return
            ids = torch.tensor(ask["block_ids"], dtype=torch.long)
            _send_msg(sock, {"ok": True})
            for kv_cache in self.kv_caches:
                sock.sendall(kv_cache[:, ids].contiguous().numpy().tobytes())
            if _recv_msg(sock).get("done"):
                self._mark_sent(request_id)
        except (OSError, ValueError, KeyError):
            return   # the consumer went away: the blocks stay until the timeout

    def _mark_sent(self, request_id: str) -> None:
        with self._lock:
            if self._serving.pop(request_id, None) is not None:
                self._done_sending.add(request_id)
                self._lock.notify_all()

    def _read_remote(self, request_id: str, load: RemoteLoad) -> None:
        """Consumer (a thread): read one request's blocks into a staging buffer."""
        staged: list[torch.Tensor] | None = None
        try:
            params = load.params
            with socket.create_connection((params["remote_host"], int(params["remote_port"])),
                                          timeout=self.load_timeout_s) as sock:
                _send_msg(sock, {"op": "read", "engine_id": params["remote_engine_id"],
                                 "request_id": params["remote_request_id"],
                                 "block_ids": list(load.remote_block_ids)})
                answer = _recv_msg(sock)
                if not answer.get("ok"):
                    raise ConnectionError(answer.get("error"))
                staged = []
                for kv_cache in self.kv_caches:
                    out = torch.empty((2, len(load.block_ids), *kv_cache.shape[2:]), dtype=kv_cache.dtype)
                    _recv_exact(sock, out.numel() * out.element_size(), memoryview(out.numpy()).cast("B"))  # type: ignore[arg-type]
                    staged.append(out)
                _send_msg(sock, {"done": True})
        except (OSError, ValueError, KeyError, TypeError) as error:
            import logging
            logging.getLogger(__name__).warning("KV load of %s failed (%s): computing its prompt", request_id, error)
            staged = None
        with self._lock:
            self._staged[request_id] = (load, staged)
            self._lock.notify_all()

    def _release_remote(self, params: dict) -> None:
        try:
            with socket.create_connection((params["remote_host"], int(params["remote_port"])), timeout=5) as sock:
                _send_msg(sock, {"op": "release", "engine_id": params["remote_engine_id"],
                                 "request_id": params["remote_request_id"]})
                _recv_msg(sock)
        except (OSError, ValueError, KeyError, TypeError):
            pass   # the producer frees them on its timeout

    def _metadata(self) -> P2PConnectorMetadata:
        metadata = self._get_connector_metadata()
        return metadata if isinstance(metadata, P2PConnectorMetadata) else P2PConnectorMetadata()

    def start_load_kv(self, **kwargs: Any) -> None:
        metadata = self._metadata()
        with self._lock:
            self._serving.update(metadata.reqs_to_send)
            self._lock.notify_all()
        for request_id, load in metadata.reqs_to_load.items():
            threading.Thread(target=self._read_remote, args=(request_id, load), daemon=True).start()
        for params in metadata.reqs_to_release.values():
            threading.Thread(target=self._release_remote, args=(params,), daemon=True).start()

    def wait_for_save(self) -> None:
        """Nothing to save: the producer's blocks are read in place by the side channel."""

    def get_finished(self, finished_req_ids: frozenset[str] | set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Copy the reads that arrived into the cache (here, inside the step: never from the
        reading thread); expire sends past their deadline. An idle step waits up to 20 ms
        for a transfer instead of spinning."""
        metadata = self._metadata()
        with self._lock:
            if metadata.idle and not self._staged and not self._done_sending:
                self._lock.wait(0.02)
            now = time.monotonic()
            for request_id, (_, deadline) in list(self._serving.items()):
                if now > deadline:
                    del self._serving[request_id]
                    self._done_sending.add(request_id)
            sending, self._done_sending = self._done_sending, set()
            staged = {rid: item for rid, item in self._staged.items()
                      if rid in metadata.loads_wanted or rid in metadata.reqs_to_load}
            for rid in staged:
                del self._staged[rid]
            for rid in list(self._staged):   # nobody waits for it any more
                if rid not in metadata.loads_wanted:
                    del self._staged[rid]
        recving: set[str] = set()
        self._failed: set[str] = set()
        for request_id, (load, tensors) in staged.items():
            if tensors is None:
                self._failed.add(request_id)
                continue
            ids = torch.tensor(load.block_ids, dtype=torch.long)
            for kv_cache, tensor in zip(self.kv_caches, tensors):
                kv_cache[:, ids] = tensor.to(device=kv_cache.device)
            recving.add(request_id)
        return sending or None, recving or None

    def get_failed_recving(self) -> set[str] | None:
        failed: set[str] = getattr(self, "_failed", set())
        self._failed = set()
        return failed or None

    def shutdown(self) -> None:
        if getattr(self, "_server", None) is not None:
            assert self._server is not None
            self._server.shutdown()
